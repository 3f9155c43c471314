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
    # DeepSeek-V3 / V3.1 (671B, 37B active): 61 layers of MLA (latent 512 + rope 64 per token),
    # the first 3 dense, then 256 routed experts top-8 in 8 groups (4 kept) of 3×7168×2048 and
    # one shared expert; 656 GB of experts in bf16 (the published weights are fp8 blocks).
    "deepseek-v3": {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rms_norm_eps": 1e-6, "dtype": "bfloat16",
    },
    # Kimi-Linear-48B-A3B: 27 layers, Kimi Delta Attention (32 heads × 128) with NoPE MLA every
    # 4th layer (transformers' default pattern), the first layer dense, then 256 experts top-8 of
    # 3×2304×1024 and one shared expert; 2304 hidden.
    "kimi-linear": {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304,
        "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
        "num_attention_heads": 32, "num_key_value_heads": 32, "num_shared_experts": 1,
        "num_experts": 256, "num_experts_per_token": 8, "routed_scaling_factor": 2.446,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "num_expert_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "moe_renormalize": True, "model_max_length": 1048576,
        "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
        "rms_norm_eps": 1e-5, "dtype": "bfloat16",
    },
    # GLM-5 (zai-org/GLM-5, `glm_moe_dsa`): 78 layers of MLA (latent 512 + rope 64, plus a
    # 128-dim indexer key per token) with DeepSeek sparse attention (32 indexer heads, top 2048
    # tokens, an indexer on every layer), the first 3 dense, then 256 experts top-8 of
    # 3×6144×2048 and one shared expert.
    "glm-5": {
        "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144,
        "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 2048, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "max_position_embeddings": 202752, "index_topk": 2048,
        "index_head_dim": 128, "index_n_heads": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rms_norm_eps": 1e-5, "eos_token_id": [154820, 154827, 154829], "bos_token_id": 0,
        "dtype": "bfloat16",
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


# GLM-5's layout at a CPU test's size (over the Qwen3 vocab the writer ships): 3 layers, the
# first dense; indexers on layers 0 and 2, layer 1 shares; index_topk 8
SHAPES["tiny-glm-5"] = dict(
    SHAPES["glm-5"], vocab_size=151680, hidden_size=64, intermediate_size=96,
    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, kv_lora_rank=48,
    q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16,
    first_k_dense_replace=1, index_topk=8, index_head_dim=32, index_n_heads=4,
    indexer_types=["full", "shared", "full"], max_position_embeddings=4096)

# Qwen3.6-35B-A3B-FP8: the same shape as released in FP8 (e4m3, 128x128 blocks with
# `weight_scale_inv`): 32.2 GB of routed experts instead of 64.4 (issue 25); and the tiny
# shape in FP8, for tests of the same tooling on a CPU.
_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}
SHAPES["qwen3.6-35b-a3b-fp8"] = dict(SHAPES["qwen3.6-35b-a3b"], quantization_config=_FP8)
SHAPES["tiny-qwen3.5-moe-fp8"] = dict(SHAPES["tiny-qwen3.5-moe"], quantization_config=_FP8)


# gpt-oss-120b / -20b as released (openai/gpt-oss-*, `config.json`): 36 / 24 layers alternating
# sliding-window (128) and full attention with sinks, 128 / 32 experts top-4 of 3x2880x2880
# with biases, MXFP4 experts (13.2 MB an expert: 60.9 / 10.2 GB of routed experts).
_GPT_OSS = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "sliding_window": 128, "num_experts_per_tok": 4,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0,
    "attention_bias": True, "tie_word_embeddings": False, "eos_token_id": 200002,
    "pad_token_id": 199999, "dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]},
}
SHAPES["gpt-oss-120b"] = dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128)
SHAPES["gpt-oss-20b"] = dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32)
# the gpt-oss layout at a CPU test's size (MXFP4 needs multiples of 32)
SHAPES["tiny-gpt-oss"] = dict(_GPT_OSS, vocab_size=151680, hidden_size=64,
                              intermediate_size=64, head_dim=16, num_attention_heads=4,
                              num_key_value_heads=2, sliding_window=8, num_hidden_layers=4,
                              num_local_experts=8, num_experts_per_tok=2)

# DeepSeek-V4-Flash (`deepseek_v4`): transformers 5.25's DeepseekV4Config defaults, which are
# V4-Flash's (its docstring names deepseek-ai/DeepSeek-V4-Flash-Base): 43 layers of shared-KV
# attention (64 heads of 512, one K=V head) with a 128-token window, compressed sparse (CSA,
# 1 entry per 4 tokens, indexer top 512) or heavily compressed (HCA, 1 per 128) attention,
# 4 hyper-connection streams; 256 experts top-6 of 3x4096x2048 and one shared expert, the
# first 3 layers hash-routed. layer_types: transformers' default (2 HCA, then CSA / HCA
# alternating; neither transformers nor MODEL_FACTS gives V4-Flash's own schedule). The
# compress rope is plain (no YaRN: the default). 284.3B parameters without the MTP layer (the
# published 284B), 277.0B of them routed experts (12.9 GB a layer in bf16); 13.8B active a
# token, embeddings and head included (the published 13B).
SHAPES["deepseek-v4-flash"] = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "q_lora_rank": 1024, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "partial_rotary_factor": 0.125, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "num_hash_layers": 3, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False, "dtype": "bfloat16",
}
# V4's layout at a CPU test's size, over the Qwen3 vocab (and ids) the writer ships: a sliding,
# a CSA, an HCA and a CSA layer, the first two hash-routed; rates 4 / 8 so a short prompt closes
# windows, index_topk 4 below a 32-token prompt's 8 CSA entries; 8 experts top-2
SHAPES["tiny-deepseek-v4"] = dict(
    SHAPES["deepseek-v4-flash"], vocab_size=151680, hidden_size=64, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, q_lora_rank=32, moe_intermediate_size=32,
    n_routed_experts=8, num_experts_per_tok=2, partial_rotary_factor=0.25,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    num_hash_layers=2, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2,
    index_head_dim=16, index_topk=4, max_position_embeddings=4096,
    bos_token_id=151643, eos_token_id=151645)  # Qwen3's <|endoftext|>, <|im_end|>


def preset_config(name: str, layers: int | None = None) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    raw = dict(SHAPES[name])
    if layers:
        raw["num_hidden_layers"] = layers
    cfg = config_from_dict(raw)
    if not cfg.moe_layers:  # deepseek-v3's first 3 layers are dense: nothing to bench
        raise ValueError(f"shape {name!r} cut to {cfg.num_layers} layers has no MoE layer; "
                         f"the first MoE layer is layer {preset_first_moe(name)}")
    return cfg


def preset_first_moe(name: str) -> int:
    return min(config_from_dict(SHAPES[name]).moe_layers)
