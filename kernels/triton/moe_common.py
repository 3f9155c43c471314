"""What the decode (fused_moe.py) and grouped (moe_grouped.py) MoE kernels share: argument
checks, block sizing, whether the interpreter runs them. One home, so neither imports the
other's module for it."""
from __future__ import annotations

import os

import torch
import triton
from torch import Tensor


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_args(x: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, y: Tensor
               ) -> tuple[int, int, int, int]:
    """Validate shapes, dtypes and layouts; returns (T, K, H, I)."""
    if x.dim() != 2 or ids.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3 or y.dim() != 3:
        raise ValueError("expected x [T,H], ids [T,K], gate_up [S,2I,H], down [S,H,I], y [T,K,H]")
    T, H = x.shape
    K = ids.shape[1]
    S, two_i, h2 = gate_up.shape
    I = two_i // 2
    if (ids.shape[0] != T or h2 != H or two_i != 2 * I or tuple(down.shape) != (S, H, I)
            or tuple(y.shape) != (T, K, H)):
        raise ValueError(
            f"shape mismatch: x={tuple(x.shape)} ids={tuple(ids.shape)} "
            f"gate_up={tuple(gate_up.shape)} down={tuple(down.shape)} y={tuple(y.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}")
    # the banks are never copied, so their rows must already be contiguous along the reduction
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("x, gate_up and down need a contiguous last dimension")
    devs = {x.device, ids.device, gate_up.device, down.device, y.device}
    if len(devs) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devs))}")
    return T, K, H, I


def _block(want: int, dim: int, least: int = 1) -> int:
    """The configured block, shrunk to the problem (tiny test shapes) but never below `least`."""
    return max(least, min(want, triton.next_power_of_2(dim)))
