"""The tensors of a DeepSeek-V4 (`deepseek_v4`) checkpoint, as `layout.expected_tensors`, and
the three namings they are found under on disk.

Names here (`expected_tensors_dsv4`) are transformers' `DeepseekV4ForCausalLM` module names,
which are also the runtime names, with the routed experts per expert as for the other
families (`mlp.experts.{e}.{gate,up,down}_proj.weight`; the fused banks are the reader's
alternative). On disk a checkpoint has one of:

- "hf": those names with 3D `mlp.experts.gate_up_proj` / `down_proj` (transformers 5.25's
  `save_pretrained(save_original_format=False)`, i.e. its `state_dict()`);
- "saved": what `save_pretrained` writes by default: transformers 5.25 has a conversion
  mapping for deepseek_v4 (conversion_mapping.py) and reverts it when saving, so the layer
  tensors get DeepSeek's names (`layers.{i}.attn.wq_a.weight`, `ffn.experts.{e}.w1.weight`,
  `hc_attn_fn`, ...) under `model.`; `lm_head.weight` becomes `head.weight`; the embeddings,
  `model.norm.weight` and `model.hc_head.*` keep the transformers names (the mapping's
  leaf patterns are anchored at the key start, which the reverse pass never matches);
- "released": DeepSeek-V4-Flash as DeepSeek publishes it, the mapping's source side: no
  prefix, `embed.weight`, `head.weight`, `norm.weight`, `hc_head_{fn,base,scale}`, the layer
  names as "saved", and `mtp.*` (multi-token prediction, skipped). The release itself is FP8
  / FP4 (refused by the config parser: dequantize to bf16 first).

`canonical_name` maps any of them to the names here; `released_name` is its inverse for the
"released" naming (what `ft bench checkpoint` writes).

Legend: H hidden, V vocab, Q q_lora_rank, Hq heads, d head_dim, g o_groups, R o_lora_rank,
Hi / Di indexer heads and head dim, m hc_mult, E experts, K top_k, I moe intermediate.
"""
from __future__ import annotations

import re

from freetoken.checkpoint.layout_parts import Shape, dense_mlp, routed_experts
from freetoken.types.model_config import ModelConfig

# (transformers suffix under `layers.{i}.`, DeepSeek's); the compressors' before the
# attention's so the longer names match first
_LAYER_NAMES = (
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.q_a_proj.", "attn.wq_a."), ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."), ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.norm."), ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."), ("self_attn.sinks", "attn.attn_sink"),
    ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"), ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
)
_TOP_NAMES = (("model.embed_tokens.weight", "embed.weight"), ("lm_head.weight", "head.weight"),
              ("model.norm.weight", "norm.weight"), ("model.hc_head.hc_fn", "hc_head_fn"),
              ("model.hc_head.hc_base", "hc_head_base"),
              ("model.hc_head.hc_scale", "hc_head_scale"))
_EXPERT_NAMES = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
_DS_TO_HF_EXPERT = {ds: hf for hf, ds in _EXPERT_NAMES}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_DS_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def _swap(suffix: str, pairs: tuple[tuple[str, str], ...], to_ds: bool) -> str | None:
    for hf, ds in pairs:
        src, dst = (hf, ds) if to_ds else (ds, hf)
        if suffix.startswith(src):
            return dst + suffix[len(src):]
    return None


def canonical_name(name: str) -> str:
    """The transformers (runtime) name of a disk tensor in any of the three namings; a name
    that is none of them (`mtp.*`, ...) comes back unchanged."""
    for hf, ds in _TOP_NAMES:
        if name in (ds, f"model.{ds}", hf, hf.removeprefix("model."), f"model.{hf}"):
            return hf
    m = _LAYER.match(name)
    if m is None:
        return name
    layer, rest = m.groups()
    e = _DS_EXPERT.match(rest)
    if e is not None:
        rest = f"mlp.experts.{e[1]}.{_DS_TO_HF_EXPERT[e[2]]}.weight"
    elif not rest.startswith(tuple(hf for hf, _ in _LAYER_NAMES) + ("mlp.experts.",)):
        rest = _swap(rest, _LAYER_NAMES, to_ds=False) or rest
    return f"model.layers.{layer}.{rest}"


def released_name(name: str) -> str:
    """DeepSeek's released name of a transformers-named tensor (per-expert experts)."""
    for hf, ds in _TOP_NAMES:
        if name == hf:
            return ds
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"{name}: not a DeepSeek-V4 tensor name")
    layer, rest = m.groups()
    e = _HF_EXPERT.match(rest)
    if e is not None:
        return f"layers.{layer}.ffn.experts.{e[1]}.{dict(_EXPERT_NAMES)[e[2]]}.weight"
    ds = _swap(rest, _LAYER_NAMES, to_ds=True)
    if ds is None:
        raise ValueError(f"{name}: no released name (fused expert banks have none)")
    return f"layers.{layer}.{ds}"


def _attention(cfg: ModelConfig, kind: str, p: str) -> dict[str, Shape]:
    spec = cfg.dsv4
    assert spec is not None
    H, Q, Hq, d = cfg.hidden_size, cfg.q_lora_rank, cfg.num_heads, cfg.head_dim
    g, R = spec.o_groups, spec.o_lora_rank
    out: dict[str, Shape] = {
        f"{p}q_a_proj.weight": (Q, H), f"{p}q_a_norm.weight": (Q,),
        f"{p}q_b_proj.weight": (Hq * d, Q), f"{p}kv_proj.weight": (d, H),
        f"{p}kv_norm.weight": (d,), f"{p}o_a_proj.weight": (g * R, Hq * d // g),
        f"{p}o_b_proj.weight": (H, g * R), f"{p}sinks": (Hq,),
    }
    if kind == "sliding":
        return out
    c = f"{p}compressor."
    rate, w = (spec.csa_rate, 2 * d) if kind == "csa" else (spec.hca_rate, d)  # CSA overlaps
    out.update({f"{c}kv_proj.weight": (w, H), f"{c}gate_proj.weight": (w, H),
                f"{c}position_bias": (rate, w), f"{c}kv_norm.weight": (d,)})
    if kind == "csa":
        ix, Hi, Di = f"{c}indexer.", cfg.index_n_heads, cfg.index_head_dim
        out.update({f"{ix}kv_proj.weight": (2 * Di, H), f"{ix}gate_proj.weight": (2 * Di, H),
                    f"{ix}position_bias": (rate, 2 * Di), f"{ix}kv_norm.weight": (Di,),
                    f"{ix}q_b_proj.weight": (Hi * Di, Q),
                    f"{ix}scorer.weights_proj.weight": (Hi, H)})
    return out


def _hc(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    assert cfg.dsv4 is not None
    m, H = cfg.dsv4.hc_mult, cfg.hidden_size
    return {f"{p}fn": ((2 + m) * m, m * H), f"{p}base": ((2 + m) * m,), f"{p}scale": (3,)}


def _moe(cfg: ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    assert cfg.dsv4 is not None
    E, H = cfg.num_experts, cfg.hidden_size
    out: dict[str, Shape] = {f"{p}gate.weight": (E, H)}
    if layer in cfg.dsv4.hash_layers:
        out[f"{p}gate.tid2eid"] = (cfg.vocab_size, cfg.top_k)  # int64 token -> experts
    else:
        out[f"{p}gate.e_score_correction_bias"] = (E,)
    out.update(routed_experts(p, E, cfg.moe_intermediate_size, H,
                              ("gate_proj", "up_proj", "down_proj")))
    out.update(dense_mlp(f"{p}shared_experts.", cfg.shared_expert_intermediate_size, H))
    return out


def expected_tensors_dsv4(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor of `cfg` by its transformers name (module docstring) and its shape, in
    the order of transformers' `state_dict()` per layer; MTP layers are not listed."""
    assert cfg.dsv4 is not None
    pre, H, m = cfg.weight_prefix, cfg.hidden_size, cfg.dsv4.hc_mult
    out: dict[str, Shape] = {f"{pre}embed_tokens.weight": (cfg.vocab_size, H)}
    for i, kind in enumerate(cfg.dsv4.kinds):
        lp = f"{pre}layers.{i}."
        out.update(_attention(cfg, kind, f"{lp}self_attn."))
        out.update(_moe(cfg, i, f"{lp}mlp."))
        out[f"{lp}input_layernorm.weight"] = (H,)
        out[f"{lp}post_attention_layernorm.weight"] = (H,)
        out.update(_hc(cfg, f"{lp}attn_hc."))
        out.update(_hc(cfg, f"{lp}ffn_hc."))
    out[f"{pre}norm.weight"] = (H,)
    out.update({f"{pre}hc_head.hc_fn": (m, m * H), f"{pre}hc_head.hc_base": (m,),
                f"{pre}hc_head.hc_scale": (1,)})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    return out


# transformers' `DeepseekV4PreTrainedModel._keep_in_fp32_modules_strict`, matched per module
# name component as transformers matches it
_FP32_MODULES = {"attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias",
                 "e_score_correction_bias", "q_a_norm", "kv_norm", "input_layernorm",
                 "post_attention_layernorm", "norm"}


def fp32_tensors_dsv4(cfg: ModelConfig) -> set[str]:
    """The tensors transformers keeps in float32 in a bf16 model: the hyper-connections
    (attn_hc, ffn_hc, hc_head), the sinks, the compressors' position biases, the routers'
    correction biases and every weighted RMSNorm (q_a_norm, kv_norm, the layer norms, norm)."""
    return {n for n in expected_tensors_dsv4(cfg) if _FP32_MODULES & set(n.split("."))}


def int_tensors_dsv4(cfg: ModelConfig) -> set[str]:
    """The hash layers' `tid2eid` tables: int64, loaded as stored (never cast)."""
    assert cfg.dsv4 is not None
    return {f"{cfg.weight_prefix}layers.{i}.mlp.gate.tid2eid" for i in cfg.dsv4.hash_layers}
