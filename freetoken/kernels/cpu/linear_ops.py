"""Decode-size linear layers on the CPU: F.linear(x, W) for a few rows, the weight streamed
once at memory bandwidth by the C++ kernel.

torch's own CPU path for a [1, K] x [N, K]^T product reads the weight at a fraction of the
host's read bandwidth (7.7 of 30 GB/s for the 151936 x 256 fp32 LM head on the 2-core dev
machine), and at decode the LM head is most of the bytes a small model reads per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken.kernels.cpu.ext import load_kernel

# Below this the ctypes call and thread team cost more than torch's GEMV loses.
MIN_WEIGHT_BYTES = 1 << 20
# Above this many rows the product is a GEMM, and torch's blocked kernels win. Measured on the
# dev machine (scripts/bench_cpu_linear.py): fp32 weights gain 1.9-3.8x at 8 rows and 1.1-2.4x
# at 16; bf16 weights 0.9-3.2x at 2 rows (below 1 only for an L3-resident weight), break even
# at 3 and lose at 8 (torch's bf16 GEMM uses the dot-product instructions this path does not).
MAX_ROWS = {torch.float32: 16, torch.bfloat16: 2}


def small_linear(x: Tensor, weight: Tensor, num_threads: int | None = None) -> Tensor:
    """F.linear(x, weight) (no bias) for x [..., K]; through the kernel when x and weight are
    on the CPU, x has at most MAX_ROWS[weight dtype] rows, the weight is contiguous fp32 or bf16
    of at least MIN_WEIGHT_BYTES and the kernel is available; else torch. The result has x's dtype,
    accumulated in fp32."""
    if weight.numel() * weight.element_size() < MIN_WEIGHT_BYTES or x.device.type != "cpu":
        return F.linear(x, weight)
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    usable = (
        weight.device.type == "cpu"
        and weight.dtype in MAX_ROWS and 0 < rows <= MAX_ROWS[weight.dtype]
        and x.shape[-1] == weight.shape[-1] and weight.dim() == 2 and weight.is_contiguous()
        and x.dtype in (torch.float32, torch.bfloat16)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )
    kern = load_kernel() if usable else None
    if kern is None:
        return F.linear(x, weight)
    x2 = x.reshape(rows, x.shape[-1]).to(torch.float32).contiguous()  # [T, K]
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)  # [T, N]
    kern.linear(x2, weight, out, num_threads)
    return out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
