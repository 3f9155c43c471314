"""HF `config.json` → `ModelConfig`, for the families we run.

Accepts both spellings seen in the wild (transformers 5 writes the first, published checkpoints
often the second): `layer_types` | `full_attention_interval`; `rope_parameters{rope_theta,
partial_rotary_factor}` | top-level `rope_theta`/`partial_rotary_factor`; `num_experts` |
`num_local_experts`; `dtype` | `torch_dtype`. A VL checkpoint (`text_config` nested, tensors under
`model.language_model.`) is read as its text model.
"""
from __future__ import annotations

import json
from pathlib import Path

from freetoken.types.config_record import (
    ConfigError,
    ExpertFormat,
    ModelConfig,
    _get,
    eos_ids_of,
    expert_nbytes,
    required_dims,
    weight_dtype,
)

__all__ = ["ConfigError", "ExpertFormat", "ModelConfig", "config_from_dict", "expert_nbytes",
           "load_config"]

FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "kimi_linear",
            "glm_moe_dsa", "gpt_oss", "deepseek_v4")
_TEXT_TYPES = {"qwen3_5_moe_text": "qwen3_5_moe"}


def expert_format_of(quant: dict | None) -> ExpertFormat | None:
    """The routed experts' format from a checkpoint's `quantization_config`: FP8 e4m3 with
    square `weight_block_size` blocks (Qwen3.6-FP8, DeepSeek-V3) gives ExpertFormat("fp8", B);
    none gives None (the model dtype). Other quantizations are refused by name."""
    if not quant:
        return None
    method = str(quant.get("quant_method", ""))
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method={method!r} is not supported "
                          "(supported: fp8 with weight_block_size)")
    if str(quant.get("fmt", "e4m3")) != "e4m3":
        raise ConfigError(f"fp8 fmt={quant.get('fmt')!r} is not supported (supported: e4m3)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1]
            and int(block[0]) > 0):
        raise ConfigError(f"fp8 weight_block_size={block!r}: square blocks [B, B] only")
    return ExpertFormat("fp8", int(block[0]))


def config_from_dict(raw: dict) -> ModelConfig:
    raw = dict(raw)
    if raw.get("model_type") == "gpt_oss":  # MXFP4 experts: its parser reads the quantization
        from freetoken.types.gpt_oss_config import gpt_oss_config

        return gpt_oss_config(raw)
    expert_format = expert_format_of(raw.get("quantization_config") or (
        raw.get("text_config") or {}).get("quantization_config"))
    prefix = "model."
    model_type = raw.get("model_type", "")
    if "text_config" in raw and isinstance(raw["text_config"], dict):
        # VL checkpoint: the language model's tensors sit under model.language_model.
        text = dict(raw["text_config"])
        for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if k not in text and k in raw:
                text[k] = raw[k]
        raw, prefix = text, "model.language_model."
        model_type = raw.get("model_type", model_type)
    model_type = _TEXT_TYPES.get(model_type, model_type)
    if model_type == "deepseek_v3":
        from freetoken.types.deepseek_config import deepseek_config

        return deepseek_config(raw, prefix)
    if model_type == "kimi_linear":
        from freetoken.types.kimi_config import kimi_config

        return kimi_config(raw, prefix)
    if model_type == "deepseek_v4":
        from freetoken.types.deepseek_v4_config import deepseek_v4_config

        return deepseek_v4_config(raw, prefix)
    if model_type == "glm_moe_dsa":
        from freetoken.types.glm_config import glm_config

        return glm_config(raw, prefix)
    if model_type not in FAMILIES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}"
        )
    hybrid = model_type in ("qwen3_next", "qwen3_5_moe")
    n_layers, hidden, n_heads, vocab = required_dims(raw)
    layer_types = raw.get("layer_types")
    if layer_types is None:
        if hybrid:
            interval = int(raw.get("full_attention_interval", 4))
            layer_types = [
                "linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(n_layers)
            ]
        else:
            layer_types = ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise ConfigError(
            f"layer_types has {len(layer_types)} entries, num_hidden_layers={n_layers}"
        )
    for t in layer_types:
        if t not in ("full_attention", "linear_attention"):
            raise ConfigError(f"unknown layer type {t!r}")
    rope = raw.get("rope_parameters") or {}
    rope_scaling = raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope_scaling.get("rope_type") or rope_scaling.get("type")
    if rope_type not in (None, "default", "mrope"):
        raise ConfigError(f"rope type {rope_type!r} is not supported yet")
    rope_theta = float(_get(rope, "rope_theta", default=_get(raw, "rope_theta", default=10000.0)))
    prf = float(
        _get(rope, "partial_rotary_factor", default=_get(raw, "partial_rotary_factor",
             default=0.25 if hybrid else 1.0))
    )
    n_experts = int(_get(raw, "num_experts", "num_local_experts", default=0))
    if expert_format is not None:
        raw["expert_format"] = expert_format  # ModelConfig.expert_format reads it
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads", default=n_heads)),
        head_dim=int(_get(raw, "head_dim", default=hidden // n_heads)),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        layer_types=tuple(layer_types),
        rope_theta=rope_theta,
        partial_rotary_factor=prf,
        max_position_embeddings=int(_get(raw, "max_position_embeddings", default=32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        zero_centered_norm=hybrid,
        attn_output_gate=hybrid,
        num_experts=n_experts,
        top_k=int(_get(raw, "num_experts_per_tok", default=0)),
        moe_intermediate_size=int(_get(raw, "moe_intermediate_size", default=0)),
        # qwen3_5_moe always renormalises (its config has no field for it)
        norm_topk_prob=bool(raw.get("norm_topk_prob", model_type == "qwen3_5_moe")),
        shared_expert_intermediate_size=int(
            _get(raw, "shared_expert_intermediate_size", default=0)
        ),
        intermediate_size=int(_get(raw, "intermediate_size", default=0)),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(_get(raw, "decoder_sparse_step", default=1)),
        linear_conv_kernel=int(_get(raw, "linear_conv_kernel_dim", default=4)),
        linear_key_head_dim=int(_get(raw, "linear_key_head_dim", default=0)),
        linear_value_head_dim=int(_get(raw, "linear_value_head_dim", default=0)),
        linear_num_key_heads=int(_get(raw, "linear_num_key_heads", default=0)),
        linear_num_value_heads=int(_get(raw, "linear_num_value_heads", default=0)),
        linear_fused_qkvz=model_type == "qwen3_next",
        weight_prefix=prefix,
        dtype=weight_dtype(raw),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids_of(raw),
        extra=raw,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"no config.json in {model_dir}")
    with open(path) as f:
        return config_from_dict(json.load(f))
