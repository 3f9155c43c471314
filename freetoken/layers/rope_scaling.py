"""RoPE with YaRN scaling (DeepSeek-V3) and the interleaved-pair rotation DeepSeek uses.

`YarnRotary` has `Rotary`'s interface (`cos_sin(positions, dtype)`): its inverse frequencies and
the factor on cos/sin are transformers' `_compute_yarn_parameters`, and `softmax_mscale` is the
extra factor DeepSeek puts on the attention scale (`yarn_get_mscale(factor, mscale_all_dim)²`).

Shapes: T tokens, R rotary dims.
"""
from __future__ import annotations

import math

import torch

from freetoken.layers.rotary import Rotary


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class YarnRotary(Rotary):
    def __init__(self, rotary_dim: int, theta: float, params: dict, max_positions: int):
        super().__init__(rotary_dim, theta)
        factor = params.get("factor")
        orig = params["original_max_position_embeddings"]
        if factor is None:  # as transformers: the ratio of the two lengths
            factor = max_positions / orig
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        att = params.get("attention_factor")
        if att is None:
            att = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                   if mscale and mscale_all else yarn_mscale(factor))
        self.attention_factor = float(att)
        self.softmax_mscale = yarn_mscale(factor, mscale_all) ** 2 if mscale_all else 1.0
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
        dim = rotary_dim

        def corr_dim(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no zero-width ramp
        pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)  # [R/2]
        idx = torch.arange(dim // 2, dtype=torch.float32, device="cpu")  # [R/2]
        ramp = ((idx - low) / (high - low)).clamp(0, 1)
        extra = 1 - ramp  # 1: keep the original frequency (extrapolate), 0: interpolate
        self.inv_freq = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, R], both times the attention factor (as transformers)
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        a = self.attention_factor
        return (emb.cos() * a).to(dtype), (emb.sin() * a).to(dtype)


def make_rotary(rotary_dim: int, theta: float, scaling: dict, max_positions: int) -> Rotary:
    if scaling.get("rope_type") == "yarn":
        return YarnRotary(rotary_dim, theta, scaling, max_positions)
    return Rotary(rotary_dim, theta)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                             ) -> torch.Tensor:
    """x [T, heads, R] with pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the
    result is laid out de-interleaved, [rotated evens | rotated odds], as transformers'
    `apply_rotary_pos_emb_interleave` (q and k alike, so their dot products are unchanged).
    cos, sin [T, R] (`cat(freqs, freqs)`: the first half holds each pair's angle)."""
    h = cos.shape[-1] // 2
    c, s = cos[:, None, :h], sin[:, None, :h]  # [T, 1, R/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, heads, R/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
