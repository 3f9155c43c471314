"""Shared bits of the Triton kernel tests: the device, a relative-error measure, a random paged
KV pool and a linear-attention config."""
from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over max |ref|: one number per tensor, independent of its scale."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite output (a poisoned row was not written?)"
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def linear_attention_config(hk: int = 2, hv: int = 4, d: int = 16, kc: int = 4,
                            hidden: int = 32):
    """A qwen3_5_moe text config whose layer 0 is Gated DeltaNet (key heads hk, value heads hv,
    dk = dv = d, conv kernel kc)."""
    from freetoken.types.model_config import config_from_dict

    return config_from_dict({
        "model_type": "qwen3_5_moe_text", "vocab_size": 64, "hidden_size": hidden,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
        "linear_conv_kernel_dim": kc, "linear_key_head_dim": d, "linear_value_head_dim": d,
        "linear_num_key_heads": hk, "linear_num_value_heads": hv, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16, "dtype": "float32",
    })


def paged_kv(lengths: list[int], heads_kv: int, head_dim: int, spare: int = 64, seed: int = 0,
             dtype: torch.dtype = torch.bfloat16, device: str = "cuda"):
    """A random paged KV pool for rows of `lengths` keys: (k_pool, v_pool [S, heads_kv,
    head_dim], indptr [B + 1] int32, slot indices [sum(lengths) + spare] int32). The slots are a
    random permutation of the pool (rows scattered, not contiguous), with `spare` more slots past
    the last row for a test that appends keys."""
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    S = total + spare + 1000
    k_pool = torch.randn(S, heads_kv, head_dim, device=device, dtype=dtype, generator=gen)
    v_pool = torch.randn(S, heads_kv, head_dim, device=device, dtype=dtype, generator=gen)
    perm = torch.randperm(S, device=device, generator=gen)
    indptr = torch.tensor([0] + list(lengths), device=device).cumsum(0).int()
    return k_pool, v_pool, indptr, perm[:total + spare].int()
