"""HF `config.json` of DeepSeek-V4 (`deepseek_v4`) → `ModelConfig`.

Missing fields take transformers' `DeepseekV4Config` defaults (V4-Flash's), folded the way its
`__post_init__` folds them, so a config reads the same here as in the oracle:

- `layer_types` as written, else from the legacy per-layer `compress_ratios` (0 / 4 / 128),
  else V4-Pro's default (two HCA layers, then CSA and HCA alternating);
- `compress_rates` as a dict, else the legacy `compress_rate_csa` / `compress_rate_hca`;
- `mlp_layer_types` as written, else `num_hash_layers` (default 3) hash-routed layers first;
- `partial_rotary_factor`, else the legacy `qk_rope_head_dim / head_dim`, else 64 / 512;
- rope: `rope_parameters` either nested ({"main": ..., "compress": ...}) or flat (the flat
  keys are the compressed branches' YaRN; the main rope is plain at `rope_theta`). A YaRN
  compress rope has `attention_factor` 1.0 unless given, as transformers forces.

Refused with a clear error: quantized checkpoints (V4 ships FP8 attention and FP4 experts:
dequantize to bf16 first), an activation other than silu, routing other than sqrtsoftplus /
softmax / sigmoid, more than one KV head, heads that do not split into `o_groups`, and layer
types outside the three attention kinds.
"""
from __future__ import annotations

from typing import Any

from freetoken.types.config_record import (
    ConfigError,
    DSV4Spec,
    ModelConfig,
    _get,
    eos_ids_of,
    required_dims,
    weight_dtype,
)

_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
          "heavily_compressed_attention": "hca"}
_RATIO_KIND = {0: "sliding_attention", 4: "compressed_sparse_attention",
               128: "heavily_compressed_attention"}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate")


def _layer_types(raw: dict, n: int) -> list[str]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        try:
            types = [_RATIO_KIND[int(r)] for r in raw["compress_ratios"]]
        except KeyError as e:
            raise ConfigError(f"deepseek_v4: compress_ratios entry {e.args[0]} is not 0, 4 or "
                              "128") from None
    if types is None:
        types = (["heavily_compressed_attention"] * min(n, 2)
                 + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                    for i in range(max(n - 2, 0))])
    types = list(types)[:n]
    bad = [t for t in types if t not in _KINDS]
    if len(types) != n or bad:
        raise ConfigError(f"deepseek_v4: layer_types must name {n} layers from "
                          f"{sorted(_KINDS)}; got {types}")
    return types


def _hash_layers(raw: dict, n: int) -> tuple[int, ...]:
    mlp = raw.get("mlp_layer_types")
    if mlp is None:
        k = raw.get("num_hash_layers")
        k = 3 if k is None else int(k)
        mlp = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
    mlp = list(mlp)[:n]
    if len(mlp) != n or any(t not in ("hash_moe", "moe") for t in mlp):
        raise ConfigError(f"deepseek_v4: mlp_layer_types must name {n} layers 'hash_moe' or "
                          f"'moe'; got {mlp}")
    return tuple(i for i, t in enumerate(mlp) if t == "hash_moe")


def _ropes(raw: dict, max_pos: int) -> tuple[float, float, tuple[tuple[str, Any], ...]]:
    """(main theta, compress theta, the compress rope's sorted YaRN parameters or ())."""
    rp = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    main_theta = float(_get(raw, "rope_theta", default=10000.0))
    comp_theta = float(_get(raw, "compress_rope_theta", default=160000.0))
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], dict(rp["compress"])
        if (main.get("rope_type") or main.get("type") or "default") != "default":
            raise ConfigError("deepseek_v4: the main rope must be the default rope")
        main_theta = float(main.get("rope_theta", main_theta))
        comp_theta = float(comp.get("rope_theta", comp_theta))
    else:
        comp = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    kind = comp.get("rope_type") or comp.get("type") or "default"
    if kind == "default":
        return main_theta, comp_theta, ()
    if kind != "yarn":
        raise ConfigError(f"deepseek_v4: compress rope type {kind!r} is not supported "
                          "(default, yarn)")
    params = {k: comp[k] for k in _YARN_KEYS if comp.get(k) is not None}
    params.setdefault("attention_factor", 1.0)  # transformers forces it for the compress rope
    params.setdefault("original_max_position_embeddings", max_pos)
    return main_theta, comp_theta, tuple(sorted({"rope_type": "yarn", **params}.items()))


def deepseek_v4_config(raw: dict, prefix: str = "model.") -> ModelConfig:
    raw = dict(raw)
    for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        raw.setdefault(k, {"num_hidden_layers": 43, "hidden_size": 4096,
                           "num_attention_heads": 64, "vocab_size": 129280}[k])
    n_layers, hidden, n_heads, vocab = required_dims(raw)
    quant = raw.get("quantization_config")
    if quant:
        raise ConfigError(f"deepseek_v4: quantized checkpoints ({quant.get('quant_method')!r})"
                          " are not supported; dequantize to bf16 first")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"deepseek_v4: hidden_act {raw['hidden_act']!r} is not supported "
                          "(silu)")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ConfigError(f"deepseek_v4: scoring_func {scoring!r} is not supported "
                          "(sqrtsoftplus, softmax, sigmoid)")
    if int(_get(raw, "num_key_value_heads", default=1)) != 1:
        raise ConfigError("deepseek_v4: num_key_value_heads must be 1 (one shared K=V head)")
    head_dim = int(_get(raw, "head_dim", default=512))
    o_groups = int(_get(raw, "o_groups", default=8))
    if n_heads % o_groups:
        raise ConfigError(f"deepseek_v4: num_attention_heads={n_heads} is not a multiple of "
                          f"o_groups={o_groups}")
    prf = raw.get("partial_rotary_factor")
    if prf is None:
        rope_dim = raw.get("qk_rope_head_dim")
        prf = rope_dim / head_dim if rope_dim is not None else 64 / 512
    rotary = int(head_dim * float(prf))
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ConfigError(f"deepseek_v4: rotary dims {rotary} of head_dim {head_dim} must be "
                          "even and positive")
    rates = dict(raw.get("compress_rates") or {})
    csa = int(rates.get("compressed_sparse_attention", _get(raw, "compress_rate_csa", default=4)))
    hca = int(rates.get("heavily_compressed_attention",
                        _get(raw, "compress_rate_hca", default=128)))
    if csa < 1 or hca < 1:
        raise ConfigError(f"deepseek_v4: compress rates must be >= 1 (csa {csa}, hca {hca})")
    max_pos = int(_get(raw, "max_position_embeddings", default=1048576))
    main_theta, comp_theta, comp_scaling = _ropes(raw, max_pos)
    types = _layer_types(raw, n_layers)
    moe_inter = int(_get(raw, "moe_intermediate_size", default=2048))
    spec = DSV4Spec(
        kinds=tuple(_KINDS[t] for t in types), csa_rate=csa, hca_rate=hca,
        compress_theta=comp_theta, compress_scaling=comp_scaling,
        hc_mult=int(_get(raw, "hc_mult", default=4)),
        hc_iters=int(_get(raw, "hc_sinkhorn_iters", default=20)),
        hc_eps=float(_get(raw, "hc_eps", default=1e-6)),
        hash_layers=_hash_layers(raw, n_layers), o_groups=o_groups,
        o_lora_rank=int(_get(raw, "o_lora_rank", default=1024)))
    return ModelConfig(
        model_type="deepseek_v4",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=1,
        head_dim=head_dim,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        layer_types=("full_attention",) * n_layers,  # every layer keeps its entries in the pool
        rope_theta=main_theta,
        partial_rotary_factor=rotary / head_dim,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=False,
        zero_centered_norm=False,
        attn_output_gate=False,
        num_experts=int(_get(raw, "n_routed_experts", "num_local_experts", default=256)),
        top_k=int(_get(raw, "num_experts_per_tok", default=6)),
        moe_intermediate_size=moe_inter,
        norm_topk_prob=True,
        shared_expert_intermediate_size=moe_inter,  # one shared expert of the experts' width
        intermediate_size=moe_inter,
        q_lora_rank=int(_get(raw, "q_lora_rank", default=1024)),
        rope_interleave=True,
        scoring_func=scoring,
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.5)),
        shared_expert_gated=False,
        index_topk=int(_get(raw, "index_topk", default=512)),
        index_head_dim=int(_get(raw, "index_head_dim", default=128)),
        index_n_heads=int(_get(raw, "index_n_heads", default=64)),
        sliding_window=int(_get(raw, "sliding_window", default=128)),
        expert_act="clamp",
        swiglu_limit=float(_get(raw, "swiglu_limit", default=10.0)),
        dsv4=spec,
        weight_prefix=prefix,
        dtype=weight_dtype(raw),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=eos_ids_of(raw, 1),
        extra=raw,
    )
