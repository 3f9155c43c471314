"""Real model shapes, for benchmarks with random weights built in memory (no checkpoint)."""
from __future__ import annotations

from freetoken.types.model_config import ModelConfig, config_from_dict

# Qwen3.6-35B-A3B (qwen3_5_moe text): 40 layers (3 gated-DeltaNet : 1 full attention),
# 256 routed experts top-8 of 3×2048×512, a shared expert; 64.4 GB of experts in bf16.
SHAPES: dict[str, dict] = {
    "qwen3.6-35b-a3b": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
        "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_experts": 256, "num_experts_per_tok": 8, "full_attention_interval": 4,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
    },
    # A tiny qwen3_5_moe over the Qwen3 vocab, for tests of the real-shape tooling on a CPU
    # (`ft bench checkpoint`, `ft bench serve`): 4 layers (3 linear : 1 full), 8 experts top-2.
    "tiny-qwen3.5-moe": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 151680, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "full_attention_interval": 4,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
    },
}


def preset_config(name: str, layers: int | None = None) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    raw = dict(SHAPES[name])
    if layers:
        raw["num_hidden_layers"] = layers
    return config_from_dict(raw)
