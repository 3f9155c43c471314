"""Decode attention on the CPU over the paged K/V pool, read in place.

The torch path gathers every key and value of the sequence out of the pool (`k_pool[slots]`)
and then runs SDPA on the copy: at 57k tokens that is 20 ms per full-attention layer and step
on the 2-core dev machine, where reading the 58 MB once takes under 2 ms. The C++ kernel
(ft_decode_attention) reads each pool row once, in place, for all query heads of its KV group,
with an online softmax split over threads.
"""
from __future__ import annotations

import torch
from torch import Tensor

from freetoken.kernels.cpu.ext import load_kernel

# Shorter sequences stay on torch: its SDPA on a small gather costs about what the call does.
MIN_KEYS = 512


def cpu_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, slots: Tensor, scale: float,
                         num_threads: int | None = None) -> Tensor | None:
    """Attention of one decode query q [Hq, D] over the pool rows `slots` [L] of k_pool, v_pool
    [S, Hk, D]: softmax(q . k * scale) . v as [Hq, D] fp32. None when this path does not apply
    (not on the CPU, fewer than MIN_KEYS keys, a layout or dtype the kernel does not take, no
    kernel): the caller runs its torch path."""
    if q.device.type != "cpu" or slots.numel() < MIN_KEYS:
        return None
    if not (k_pool.dtype == v_pool.dtype and k_pool.dtype in (torch.float32, torch.bfloat16)
            and k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.dim() == 3
            and q.dim() == 2 and q.shape[1] == k_pool.shape[2]):
        return None
    kern = load_kernel()
    if kern is None:
        return None
    qf = q.to(torch.float32).contiguous()  # [Hq, D]
    idx = slots.to(torch.int64).contiguous()  # [L]
    out = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32)  # [Hq, D]
    if not kern.decode_attention(qf, k_pool, v_pool, idx, scale, out, num_threads):
        return None
    return out
