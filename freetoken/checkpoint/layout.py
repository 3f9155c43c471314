"""Which tensors a checkpoint of each family holds on disk, and their shapes.

Names are the HF safetensors names (per-expert layout, `cfg.weight_prefix` on everything but
`lm_head.weight`), as `save_pretrained` in transformers 5 and the published Qwen checkpoints
write them (MODEL_FACTS §2). The checkpoint reader validates against this before converting
anything, and the runtime names derive from it (`runtime_name`).

Legend: H hidden, E experts, I moe intermediate, D dense intermediate, S shared intermediate,
hd head_dim, Hq/Hkv attention heads, Hk/Hv linear key/value heads, dk/dv their head dims.
"""
from __future__ import annotations

from freetoken.checkpoint.layout_parts import Shape, decoder_stack, dense_mlp, routed_experts
from freetoken.types.model_config import ModelConfig


def _attention(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    H, hd = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)  # per head [q | gate]
    kv_rows = cfg.num_kv_heads * hd
    out = {
        f"{p}q_proj.weight": (q_rows, H),
        f"{p}k_proj.weight": (kv_rows, H),
        f"{p}v_proj.weight": (kv_rows, H),
        f"{p}o_proj.weight": (H, cfg.num_heads * hd),
        f"{p}q_norm.weight": (hd,),
        f"{p}k_norm.weight": (hd,),
    }
    if cfg.attention_bias:
        out.update({
            f"{p}q_proj.bias": (q_rows,),
            f"{p}k_proj.bias": (kv_rows,),
            f"{p}v_proj.bias": (kv_rows,),
            f"{p}o_proj.bias": (H,),
        })
    return out


def _linear_attention(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    H, Hv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    key_dim, value_dim = cfg.linear_key_dim, cfg.linear_value_dim
    out: dict[str, Shape] = {}
    if cfg.linear_fused_qkvz:
        # qwen3_next: rows grouped per K-head, [q_g | k_g | v_g | z_g] and [b_g | a_g]
        out[f"{p}in_proj_qkvz.weight"] = (2 * key_dim + 2 * value_dim, H)
        out[f"{p}in_proj_ba.weight"] = (2 * Hv, H)
    else:
        out[f"{p}in_proj_qkv.weight"] = (2 * key_dim + value_dim, H)  # [q all | k all | v all]
        out[f"{p}in_proj_z.weight"] = (value_dim, H)
        out[f"{p}in_proj_b.weight"] = (Hv, H)
        out[f"{p}in_proj_a.weight"] = (Hv, H)
    out.update({
        f"{p}conv1d.weight": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel),  # depthwise
        f"{p}A_log": (Hv,),
        f"{p}dt_bias": (Hv,),
        f"{p}norm.weight": (dv,),
        f"{p}out_proj.weight": (H, value_dim),
    })
    return out


def _mlp(cfg: ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    H = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return dense_mlp(p, cfg.intermediate_size, H)
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, Shape] = {f"{p}gate.weight": (E, H)}
    out.update(routed_experts(p, E, I, H, ("gate_proj", "up_proj", "down_proj")))
    S = cfg.shared_expert_intermediate_size
    if S > 0:
        out.update(dense_mlp(f"{p}shared_expert.", S, H))
        out[f"{p}shared_expert_gate.weight"] = (1, H)
    return out


def expected_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor name on disk for `cfg` and its shape, in a stable order.

    Routed experts are listed per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`); a
    checkpoint that stores them already fused is accepted by the reader (see
    `fused_expert_tensors`). No `lm_head.weight` when the embeddings are tied.
    """
    if cfg.is_mla:  # deepseek_v3: its own attention and MoE tensors
        from freetoken.checkpoint.layout_mla import expected_tensors_mla

        return expected_tensors_mla(cfg)
    if cfg.model_type == "gpt_oss":  # fused experts with biases, MXFP4 or dense
        from freetoken.checkpoint.gpt_oss import expected_tensors_gpt_oss

        return expected_tensors_gpt_oss(cfg)
    if cfg.dsv4 is not None:  # transformers' names; the disk namings map to them
        from freetoken.checkpoint.layout_dsv4 import expected_tensors_dsv4

        return expected_tensors_dsv4(cfg)

    def attention(i: int, lp: str) -> dict[str, Shape]:
        if cfg.layer_types[i] == "linear_attention":
            return _linear_attention(cfg, f"{lp}linear_attn.")
        return _attention(cfg, f"{lp}self_attn.")

    return decoder_stack(cfg, attention, lambda i, lp: _mlp(cfg, i, f"{lp}mlp."))


def fp32_tensors(cfg: ModelConfig) -> set[str]:
    """Disk names loaded in float32 whatever the model dtype: DeepSeek-V3's router weight and
    correction bias (transformers' `_keep_in_fp32_modules_strict`; a bias rounded to bf16 picks
    other experts); DeepSeek-V4's hyper-connections, sinks, position biases, correction biases
    and norms (layout_dsv4.py)."""
    if cfg.dsv4 is not None:
        from freetoken.checkpoint.layout_dsv4 import fp32_tensors_dsv4

        return fp32_tensors_dsv4(cfg)
    if not cfg.is_mla:
        return set()
    from freetoken.checkpoint.layout_mla import router_tensors

    return router_tensors(cfg)


def int_tensors(cfg: ModelConfig) -> set[str]:
    """Disk names of integer tensors, loaded as stored whatever the model dtype (DeepSeek-V4's
    hash-routing `tid2eid`, int64)."""
    if cfg.dsv4 is None:
        return set()
    from freetoken.checkpoint.layout_dsv4 import int_tensors_dsv4

    return int_tensors_dsv4(cfg)


def disk_aliases(cfg: ModelConfig, names: list[str]) -> dict[str, str]:
    """{name on disk: the name `expected_tensors` uses} for the names a family stores under
    other spellings (DeepSeek-V4's released / `save_pretrained` namings); {} for the rest."""
    if cfg.dsv4 is None:
        return {}
    from freetoken.checkpoint.layout_dsv4 import canonical_name

    return {n: c for n in names if (c := canonical_name(n)) != n}


def expert_bank_names(cfg: ModelConfig, layer: int, prefix: str | None = None) -> tuple[str, str]:
    """(gate_up_proj, down_proj) bank names of an MoE layer under `prefix` (default: on disk)."""
    p = (f"{cfg.weight_prefix if prefix is None else prefix}layers.{layer}."
         f"{cfg.moe_module}.experts.")
    return f"{p}gate_up_proj", f"{p}down_proj"


def fused_expert_tensors(cfg: ModelConfig, layer: int) -> dict[str, Shape]:
    """The fused-bank alternative to a layer's per-expert tensors: [E, 2I, H] and [E, H, I]."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_up, down = expert_bank_names(cfg, layer)
    return {gate_up: (E, 2 * I, H), down: (E, H, I)}


def runtime_name(cfg: ModelConfig, disk_name: str) -> str:
    """The runtime name of a non-expert disk tensor: the prefix normalised to `model.`."""
    if disk_name.startswith(cfg.weight_prefix):
        return "model." + disk_name[len(cfg.weight_prefix):]
    return disk_name


def expected_runtime(cfg: ModelConfig) -> dict[str, Shape]:
    """Every runtime tensor (what the reader returns and FTW stores) and its shape: disk names
    renamed, per-expert tensors as one bank per MoE layer, qwen3_next's fused linear-attention
    projections as qwen3_5's four."""
    out: dict[str, Shape] = {}
    H, Hv = cfg.hidden_size, cfg.linear_num_value_heads
    experts = f".{cfg.moe_module}.experts."  # per-expert tensors: banks, below
    for name, shape in expected_tensors(cfg).items():
        if experts in name:
            continue
        if cfg.linear_fused_qkvz and name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
            rt = runtime_name(cfg, name).rsplit(".", 2)[0] + "."
            if name.endswith("in_proj_qkvz.weight"):
                out[rt + "in_proj_qkv.weight"] = (2 * cfg.linear_key_dim + cfg.linear_value_dim, H)
                out[rt + "in_proj_z.weight"] = (cfg.linear_value_dim, H)
            else:
                out[rt + "in_proj_b.weight"] = (Hv, H)
                out[rt + "in_proj_a.weight"] = (Hv, H)
            continue
        out[runtime_name(cfg, name)] = shape
    for i in cfg.moe_layers:
        for name, shape in fused_expert_tensors(cfg, i).items():
            out[runtime_name(cfg, name)] = shape
    return out
