"""Tiny random DeepSeek-V3 and Kimi-Linear checkpoints (built by
`tests.models.fixtures.build_tiny_hf`).

Kinds: `deepseek_v3` (q LoRA, YaRN with mscale != mscale_all_dim so both the cos/sin factor and
the softmax mscale are exercised, interleaved rope, 2 shared experts), `deepseek_v3_no_q_lora`
(q_proj, plain rope, rope_interleave off, attention biases, norm_topk_prob off),
`deepseek_v3_old_spelling` (the published config's `rope_scaling` + top-level `rope_theta`).
`kimi_linear` (KDA : NoPE MLA layers 3 : 2, a dense first layer, q_proj),
`glm_moe_dsa` (GLM-5: sparse attention with indexers on layers 0 and 2, shared on 1 and 3),
`glm_moe_dsa_yarn` (YaRN and attention biases), `glm_moe_dsa_freq_spelling` (no `indexer_types`:
`index_topk_freq` / `index_skip_topk_offset`, as transformers derives the list),
`kimi_linear_published_spelling` (the checkpoint's `linear_attn_config` with 1-indexed
`kda_layers` / `full_attn_layers` and `first_k_dense_replace` instead of the layer-type lists).
The latent (kv_lora_rank + rope = 64) is a multiple of the C++ decode kernel's vector width.
"""
from __future__ import annotations

from typing import Any

import torch

KINDS = ("deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3_old_spelling", "kimi_linear",
         "kimi_linear_published_spelling", "glm_moe_dsa", "glm_moe_dsa_yarn",
         "glm_moe_dsa_freq_spelling")

# GLM-5 (`glm_moe_dsa`): 4 layers, indexers on layers 0 and 2 (1 and 3 share their choice);
# index_topk 24 is below the tests' prompt lengths, so the sparse choice changes the logits
_GLM: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 48, "q_lora_rank": 32, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "qk_nope_head_dim": 16, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 512,
    "index_topk": 24, "index_head_dim": 32, "index_n_heads": 8,
    "indexer_types": ["full", "shared", "full", "shared"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

_KIMI: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "num_local_experts": 8, "routed_scaling_factor": 2.446,
    "kv_lora_rank": 48, "q_lora_rank": None, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "qk_nope_head_dim": 16, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "max_position_embeddings": 512, "linear_head_dim": 16,
    "linear_num_heads": 2, "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                    "full_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 0.8}

_BASE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 2, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 48, "q_lora_rank": 32, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "qk_nope_head_dim": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0,
}


@torch.no_grad()
def make_deepseek(kind: str) -> torch.nn.Module:
    import transformers as tf

    if kind.startswith("kimi_linear"):
        model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**_KIMI))
    elif kind.startswith("glm_moe_dsa"):
        kw = dict(_GLM)
        if kind == "glm_moe_dsa_yarn":
            kw.update(rope_parameters=dict(_YARN), attention_bias=True)
        model = tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**kw))
    else:
        model = _deepseek(tf, kind)
    gen = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        ix = getattr(getattr(layer, "self_attn", None), "indexer", None)
        if ix is not None:  # a zero LayerNorm bias (the init) would leave it untested
            ix.k_norm.bias.copy_(torch.randn(ix.k_norm.bias.shape, generator=gen) * 0.1)
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        gate = getattr(mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            # a zero bias (the init) would leave the biased choice untested
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape,
                                                           generator=gen) * 0.05)
    return model


def _deepseek(tf, kind: str) -> torch.nn.Module:
    kw = dict(_BASE, rope_parameters=dict(_YARN))
    if kind == "deepseek_v3_no_q_lora":
        kw.update(q_lora_rank=None, rope_interleave=False, attention_bias=True,
                  norm_topk_prob=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**kw))


def rewrite_deepseek_config(cfg: dict, kind: str) -> dict:
    if kind == "deepseek_v3_old_spelling":
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        rope["type"] = rope.pop("rope_type")
        cfg["rope_scaling"] = rope
        cfg["torch_dtype"] = cfg.pop("dtype")
    if kind == "glm_moe_dsa_freq_spelling":
        # transformers derives [full, shared, full, shared] from these two fields
        assert cfg.pop("indexer_types") == ["full", "shared", "full", "shared"]
        cfg.pop("mlp_layer_types")
        cfg.update(index_topk_freq=2, index_skip_topk_offset=1)
    if kind == "kimi_linear_published_spelling":
        lt = cfg.pop("layer_types")
        cfg["linear_attn_config"] = {
            "head_dim": cfg.pop("linear_head_dim"), "num_heads": cfg.pop("linear_num_heads"),
            "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim"),
            "kda_layers": [i + 1 for i, t in enumerate(lt) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(lt) if t == "full_attention"]}
        mt = cfg.pop("mlp_layer_types")
        cfg["first_k_dense_replace"] = mt.index("sparse")
    return cfg
