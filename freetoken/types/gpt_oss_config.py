"""HF `config.json` of gpt-oss (`gpt_oss`) → `ModelConfig`.

gpt-oss alternates sliding-window and full attention (`layer_types` "sliding_attention" /
"full_attention"; transformers' default when absent: even layers slide), every attention layer
with a learned sink logit per head and biases on q/k/v/o; every layer is MoE: a router with a
bias, top-k over its logits then a softmax over the k, experts with biases and the clamped SwiGLU
`(clamp(up, ±limit) + 1) · g · σ(alpha · g)`, g = clamp(gate, max=limit). RoPE is YaRN from
`rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (the published configs);
missing fields take transformers' `GptOssConfig` defaults. The published weights keep the
routed experts in MXFP4 (`quantization_config.quant_method: mxfp4`): ExpertFormat("mxfp4", 32).

Every layer's KV lives in the paged pool (all are `full_attention` to the KV pool); the sliding
layers are listed in `sliding_layers` and mask keys outside their window.
"""
from __future__ import annotations

from freetoken.types.config_record import (
    ConfigError,
    ExpertFormat,
    ModelConfig,
    _get,
    eos_ids_of,
    required_dims,
    weight_dtype,
)

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "truncate", "attention_factor", "mscale", "mscale_all_dim")
# transformers' GptOssConfig default RoPE
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def _expert_format(quant: dict | None) -> ExpertFormat | None:
    if not quant:
        return None
    method = str(quant.get("quant_method", ""))
    if method != "mxfp4":
        raise ConfigError(f"gpt_oss: quantization_config.quant_method={method!r} is not "
                          "supported (supported: mxfp4, as the released checkpoints)")
    return ExpertFormat("mxfp4", 32)


def _rope(raw: dict) -> tuple[float, tuple]:
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or _DEFAULT_ROPE)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(_get(rope, "rope_theta", default=_get(raw, "rope_theta", default=150000.0)))
    if rope_type == "default":
        return theta, ()
    if rope_type != "yarn":
        raise ConfigError(f"gpt_oss: rope type {rope_type!r} is not supported (default, yarn)")
    params = {k: rope[k] for k in _YARN_KEYS if rope.get(k) is not None}
    params.setdefault("original_max_position_embeddings", 4096)
    return theta, tuple(sorted({"rope_type": "yarn", **params}.items()))


def gpt_oss_config(raw: dict, prefix: str = "model.") -> ModelConfig:
    n_layers, hidden, n_heads, vocab = required_dims(raw)
    kinds = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(n_layers)]
    if len(kinds) != n_layers or any(k not in ("sliding_attention", "full_attention")
                                     for k in kinds):
        raise ConfigError(f"gpt_oss: layer_types {kinds} do not name {n_layers} known kinds "
                          "(sliding_attention, full_attention)")
    window = int(_get(raw, "sliding_window", default=128))
    sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    if sliding and window < 1:
        raise ConfigError(f"gpt_oss: sliding_window={window} with sliding layers")
    fmt = _expert_format(raw.get("quantization_config"))
    inter = int(_get(raw, "intermediate_size", default=2880))
    theta, scaling = _rope(raw)
    extra = dict(raw)
    if fmt is not None:
        extra["expert_format"] = fmt
    return ModelConfig(
        model_type="gpt_oss",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads", default=n_heads)),
        head_dim=int(_get(raw, "head_dim", default=hidden // n_heads)),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-5)),
        layer_types=("full_attention",) * n_layers,
        rope_theta=theta,
        partial_rotary_factor=1.0,
        max_position_embeddings=int(_get(raw, "max_position_embeddings", default=131072)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", True)),
        zero_centered_norm=False,
        attn_output_gate=False,
        num_experts=int(_get(raw, "num_local_experts", "num_experts", default=128)),
        top_k=int(_get(raw, "num_experts_per_tok", "experts_per_token", default=4)),
        moe_intermediate_size=inter,
        norm_topk_prob=True,  # softmax over the top-k logits = renormalised top-k softmax
        shared_expert_intermediate_size=0,
        intermediate_size=0,
        rope_scaling=scaling,
        attention_sinks=True,
        sliding_window=window if sliding else 0,
        sliding_layers=sliding,
        expert_act="swiglu_oai",
        swiglu_alpha=float(_get(raw, "swiglu_alpha", default=1.702)),
        swiglu_limit=float(_get(raw, "swiglu_limit", default=7.0)),
        moe_module="mlp",
        weight_prefix=prefix,
        dtype=weight_dtype(raw),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids_of(raw),
        extra=extra,
    )
