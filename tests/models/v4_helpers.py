"""A tiny DeepSeek-V4 pair for the tests: transformers' `DeepseekV4ForCausalLM` (the oracle)
with random weights of a useful size (sinks, position biases, correction biases, the hash
table all non-zero) and ours with the same tensors by name.

The config has one layer of each attention kind (HCA rate 8, CSA rate 4 with index_topk 3,
far below the compressed count of the tests' prompts, and a sliding-only layer), a window of 8,
a hash-routed first layer, YaRN on the compress rope, 4 residual streams, o_groups 2."""
from __future__ import annotations

import sys
from typing import Any

import torch

from freetoken.cache.tensors import Caches, KVPool
from freetoken.models.deepseek_v4 import DeepseekV4
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import config_from_dict

V4_CONFIG: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 16, "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 2, "n_routed_experts": 8,
    "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention",
                 "sliding_attention", "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "sliding_window": 8, "o_groups": 2,
    "o_lora_rank": 8, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 3,
    "swiglu_limit": 1.5,
    "hc_sinkhorn_iters": 5, "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1}}


def tiny_v4(seed: int = 1, **overrides: Any) -> tuple[torch.nn.Module, DeepseekV4]:
    """(transformers' model, ours) in fp32 with equal weights."""
    sys.modules.setdefault("fla", None)  # type: ignore[arg-type]
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hc = DeepseekV4Config(**{**V4_CONFIG, **overrides})
    hc._attn_implementation = "eager"
    ref = DeepseekV4ForCausalLM(hc).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else 0.3))
        E, K = hc.n_routed_experts, hc.num_experts_per_tok
        for n, b in ref.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:K]
                                     for _ in range(hc.vocab_size)]))
            elif n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    ours = DeepseekV4(config_from_dict(hc.to_dict())).float()
    sd = ref.state_dict()
    missing = set(ours.state_dict()) ^ set(sd)
    assert not missing, f"parameter names differ from transformers': {sorted(missing)[:8]}"
    ours.load_state_dict(sd)
    return ref, ours


def pool(model: DeepseekV4, n: int) -> Caches:
    return Caches(KVPool(model.cfg, n, torch.float32, "cpu"), None)


def run(model: DeepseekV4, caches: Caches, ids: list[int], prefix: int, slots: torch.Tensor
        ) -> torch.Tensor:
    """Logits of every new token of one sequence ([n, V])."""
    return model(ForwardBatch.single(ids, prefix, slots, None, all_logits=True), caches)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
