"""HF `config.json` of DeepSeek-V3 (`deepseek_v3`) → `ModelConfig`.

Missing fields take transformers' `DeepseekV3Config` defaults, so a config reads the same here
as in the oracle (an absent `q_lora_rank` is 1536; an explicit null means no q LoRA). RoPE is read
from `rope_parameters` (transformers 5) or `rope_scaling` + top-level `rope_theta` (the published
checkpoints); types other than default and yarn are refused. Routing must be DeepSeek-V3's:
sigmoid scores with a correction bias (`scoring_func` sigmoid, `topk_method` noaux_tc when given).
"""
from __future__ import annotations

from typing import Any

from freetoken.types.config_record import (
    ConfigError,
    ModelConfig,
    _get,
    eos_ids_of,
    required_dims,
    weight_dtype,
)

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate")


def _rope(raw: dict) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(rope_theta, sorted yarn parameters or ())."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(_get(rope, "rope_theta", default=_get(raw, "rope_theta", default=10000.0)))
    if rope_type == "default":
        return theta, ()
    if rope_type != "yarn":
        raise ConfigError(f"deepseek_v3: rope type {rope_type!r} is not supported (default, yarn)")
    params = {k: rope[k] for k in _YARN_KEYS if rope.get(k) is not None}
    # transformers: the pretraining length defaults to max_position_embeddings
    params.setdefault("original_max_position_embeddings",
                      raw.get("original_max_position_embeddings",
                              raw.get("max_position_embeddings", 4096)))
    return theta, tuple(sorted({"rope_type": "yarn", **params}.items()))


def deepseek_config(raw: dict, prefix: str = "model.") -> ModelConfig:
    n_layers, hidden, n_heads, vocab = required_dims(raw)
    quant = raw.get("quantization_config")
    if quant:
        # the published weights are fp8 blocks with `weight_scale_inv` beside them: read as
        # plain tensors (the scales skipped as unused) they would load as garbage
        raise ConfigError(f"deepseek_v3: quantized checkpoints ({quant.get('quant_method')!r}) "
                          "are not supported; dequantize to bf16 first")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"deepseek_v3: hidden_act {act!r} is not supported (silu)")
    scoring = raw.get("scoring_func", "sigmoid")
    method = raw.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise ConfigError(f"deepseek_v3: routing scoring_func={scoring!r} topk_method={method!r}"
                          " is not supported (sigmoid, noaux_tc)")
    q_lora = raw.get("q_lora_rank", 1536)
    nope = int(_get(raw, "qk_nope_head_dim", default=128))
    rope_dim = int(_get(raw, "qk_rope_head_dim", default=64))
    n_experts = int(_get(raw, "n_routed_experts", "num_local_experts", default=256))
    n_group = int(_get(raw, "n_group", default=8))
    if n_experts % n_group:
        raise ConfigError(f"deepseek_v3: n_routed_experts={n_experts} is not a multiple of "
                          f"n_group={n_group}")
    topk_group = int(_get(raw, "topk_group", default=4))
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"deepseek_v3: topk_group={topk_group} outside [1, n_group={n_group}]")
    moe_inter = int(_get(raw, "moe_intermediate_size", default=2048))
    first_dense = int(_get(raw, "first_k_dense_replace", default=3))
    theta, scaling = _rope(raw)
    return ModelConfig(
        model_type="deepseek_v3",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=1,  # one latent per token (cfg.kv_entry)
        head_dim=nope + rope_dim,  # the query / key head dim
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        layer_types=("full_attention",) * n_layers,
        rope_theta=theta,
        partial_rotary_factor=1.0,
        max_position_embeddings=int(_get(raw, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        zero_centered_norm=False,
        attn_output_gate=False,
        num_experts=n_experts,
        top_k=int(_get(raw, "num_experts_per_tok", default=8)),
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=moe_inter * int(_get(raw, "n_shared_experts", default=1)),
        intermediate_size=int(_get(raw, "intermediate_size", default=18432)),
        mlp_only_layers=tuple(range(min(first_dense, n_layers))),
        q_lora_rank=int(q_lora) if q_lora else 0,
        kv_lora_rank=int(_get(raw, "kv_lora_rank", default=512)),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(_get(raw, "v_head_dim", default=128)),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        rope_scaling=scaling,
        scoring_func="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=2.5)),
        shared_expert_gated=False,
        weight_prefix=prefix,
        dtype=weight_dtype(raw),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=eos_ids_of(raw, 1),
        extra=raw,
    )
