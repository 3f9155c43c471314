"""Rotary position embedding with partial rotary (rotate-half convention)."""
from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        ar = torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu")
        inv = 1.0 / (theta ** (ar / rotary_dim))
        # a plain attribute, not a buffer: stays fp32 when the module is cast to bf16
        self.inv_freq = inv
        self.rotary_dim = rotary_dim

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, rotary_dim]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, R] with R <= D: rotate the first R dims, pass the rest."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
