"""Kimi Delta Attention decode step on the state pool in place: the gated delta rule with a
per-channel decay, one launch, indexed by state slot (no gather, no scatter). The short conv
before it is gated DeltaNet's (`freetoken.kernels.triton.gdn.causal_conv1d_update_pool`).

Pool (`freetoken.cache.tensors.StateTensors`): ssm_pool [S, H, K, V] fp32; `slots` [B] (int32
or int64) names each row's slot, distinct within a launch. Semantics are `recurrent_kda`'s
(freetoken/layers/kda_rule.py), per head with state S [K, V]:

    S ← diag(exp(g))·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀ(q·K^-½)

q, k arrive L2-normalised. Each program owns one (row, head, V block): the update is column-wise
in V, so V blocks are independent and the state is read once and written once. The grid depends
on shapes only and nothing is read back to the host: capturable in a CUDA graph.

Shapes: B rows, H heads, K key dim, V value dim, S state slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ssm_ptr, slots_ptr, o_ptr,
    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_gh, s_bb, s_bh,
    s_ss, s_sh, s_sk, s_ob, s_oh, scale,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)  # [BK]
    k_ok = kk < DK
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
    v_ok = vv < DV
    q = tl.load(q_ptr + b * s_qb + h * s_qh + kk, mask=k_ok, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + b * s_kb + h * s_kh + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
    g = tl.load(g_ptr + b * s_gb + h * s_gh + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
    v = tl.load(v_ptr + b * s_vb + h * s_vh + vv, mask=v_ok, other=0.0).to(tl.float32)  # [BV]
    beta = tl.load(beta_ptr + b * s_bb + h * s_bh).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    sp = ssm_ptr + slot * s_ss + h * s_sh + kk[:, None] * s_sk + vv[None, :]  # [BK, BV]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(sp, mask=tile_ok, other=0.0) * tl.exp(g)[:, None]  # [BK, BV] fp32
    kv_mem = tl.sum(s * k[:, None], 0)  # [BV]
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)  # [BV]
    tl.store(sp, s, mask=tile_ok)
    tl.store(o_ptr + b * s_ob + h * s_oh + vv, o, mask=v_ok)


def kda_recurrent_pool(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       ssm_pool: Tensor, slots: Tensor, out: Tensor | None = None) -> Tensor:
    """One decode step for B rows. q, k [B, H, K] L2-normalised (q scaled by K^-½ here);
    v [B, H, V]; g [B, H, K] log decay; beta [B, H]; ssm_pool [S, H, K, V] fp32, rows `slots`
    [B] read and overwritten in place. Returns o [B, H, V] fp32."""
    B, H, dk = q.shape
    dv = v.shape[2]
    if (k.shape != q.shape or g.shape != q.shape or v.shape[:2] != (B, H)
            or beta.shape != (B, H) or ssm_pool.shape[1:] != (H, dk, dv)):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, ssm_pool "
                         f"{tuple(ssm_pool.shape)} do not match")
    if ssm_pool.dtype != torch.float32:
        raise ValueError("ssm_pool must be float32")
    if any(t.stride(-1) != 1 for t in (q, k, v, g, ssm_pool)):
        raise ValueError("the head dims of q, k, v, g and ssm_pool must be contiguous")
    if out is None:
        out = torch.empty(B, H, dv, dtype=torch.float32, device=q.device)  # [B, H, V]
    bv = min(32, triton.next_power_of_2(dv))
    _kda_recurrent_kernel[(B, H, triton.cdiv(dv, bv))](
        q, k, v, g, beta, ssm_pool, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        ssm_pool.stride(0), ssm_pool.stride(1), ssm_pool.stride(2), out.stride(0),
        out.stride(1), dk ** -0.5,
        DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv, num_warps=4,
    )
    return out
