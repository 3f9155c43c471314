"""Layout conversions from checkpoint tensors to the runtime layout.

The runtime runs one gated-DeltaNet layout, qwen3_5's: `in_proj_qkv` rows [q all heads | k all
heads | v all heads], `in_proj_z`, `in_proj_b`, `in_proj_a` with value heads in order g·r + j
(g the K-head group, j its r = Hv/Hk value heads). qwen3_next stores the same weights fused and
grouped per K-head; `split_qkvz` / `split_ba` regroup them without changing any value.
"""
from __future__ import annotations

import torch
from torch import Tensor


def split_qkvz(
    w: Tensor, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[Tensor, Tensor]:
    """qwen3_next `in_proj_qkvz.weight` → (`in_proj_qkv.weight`, `in_proj_z.weight`).

    Hk K-heads, r = Hv/Hk, dk/dv head dims, H hidden.
    w: [Hk·(2dk + 2r·dv), H], per group g the rows are [q_g(dk) | k_g(dk) | v_g(r·dv) | z_g(r·dv)].
    Returns qkv [2·Hk·dk + Hv·dv, H] and z [Hv·dv, H], contiguous.
    """
    if num_v_heads % num_k_heads:
        raise ValueError(
            f"linear value heads {num_v_heads} not a multiple of key heads {num_k_heads}"
        )
    r = num_v_heads // num_k_heads
    dk, rdv = head_k_dim, r * head_v_dim
    H = w.shape[-1]
    g = w.reshape(num_k_heads, 2 * dk + 2 * rdv, H)  # [Hk, 2dk + 2r·dv, H]
    q, k, v, z = g.split([dk, dk, rdv, rdv], dim=1)  # [Hk, dk, H] ×2, [Hk, r·dv, H] ×2
    qkv = torch.cat((
        q.reshape(num_k_heads * dk, H),  # [Hk·dk, H]
        k.reshape(num_k_heads * dk, H),  # [Hk·dk, H]
        v.reshape(num_v_heads * head_v_dim, H),  # [Hv·dv, H], head g·r + j
    ))  # [2·Hk·dk + Hv·dv, H]
    return qkv, z.reshape(num_v_heads * head_v_dim, H).contiguous()  # z: [Hv·dv, H]


def split_ba(w: Tensor, num_k_heads: int, num_v_heads: int) -> tuple[Tensor, Tensor]:
    """qwen3_next `in_proj_ba.weight` [2·Hv, H] (per group [b_g(r) | a_g(r)]) → (b, a),
    each [Hv, H]."""
    r = num_v_heads // num_k_heads
    H = w.shape[-1]
    b, a = w.reshape(num_k_heads, 2 * r, H).split([r, r], dim=1)  # [Hk, r, H] each
    return b.reshape(num_v_heads, H).contiguous(), a.reshape(num_v_heads, H).contiguous()

