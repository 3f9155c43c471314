"""RMSNorm variants of the Qwen families (dtype handling mirrors transformers exactly)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _triton_norm(x: torch.Tensor):
    """The Triton norm kernels (one launch instead of ~8) for CUDA tensors, else None."""
    from freetoken.kernels import dispatch

    return dispatch.triton_for(x, "norm")


def add_rmsnorm(norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + h), residual + h): the pre-norm decoder's residual add and the next
    norm, one launch on CUDA."""
    mod = _triton_norm(h)
    if mod is not None:
        return mod.rmsnorm(h, norm.weight, norm.eps, norm.zero_centered, residual=residual)
    x = residual + h
    return norm(x), x


class RMSNorm(nn.Module):
    """`zero_centered`: y = norm(x) * (1 + w) computed in fp32 (qwen3_next / qwen3_5);
    else y = w * norm(x) cast back to x's dtype first (qwen3_moe)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mod = _triton_norm(x)
        if mod is not None:
            return mod.rmsnorm(x, self.weight, self.eps, self.zero_centered)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet output norm: (w * norm(x)) * silu(z), plain weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor, x_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
        """`x_dtype`: round x to it first (the result is in it), in the same launch on CUDA."""
        mod = _triton_norm(x)
        if mod is not None:
            return mod.gated_rmsnorm(x, z, self.weight, self.eps, x_dtype)
        if x_dtype is not None:
            x = x.to(x_dtype)
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dt)
        return (y * F.silu(z.float())).to(dt)
