"""Absorbed multi-head latent attention decode over the paged latent pool in place (page size 1).

Pool layout (`freetoken.cache.tensors.KVPool` for MLA): pool [S, 1, C+R], one latent per token
([kv_lora_rank C | rope R]); sequence b's latents sit at slots kv_indices[kv_indptr[b]:
kv_indptr[b+1]] (CSR, int32 or int64), any order. The query is already absorbed
(`MLAttention.absorb_query`): q_lat [B, Hq, C+R]. Every head attends over the same latents (one
KV "head"), the values being the latents' first C dims:

    o[b, h] = softmax_j(q_lat[b, h] · pool[j] · scale) · pool[j, :C]        -> [B, Hq, C]

Flash-decoding: program (b, head block, split) walks its share of b's latents once for its
BLOCK_H heads (each latent row read once per head block, not per head), with a running max and
sum in fp32; a second kernel merges the splits by their log-sum-exp. C and R need not be powers
of two (masked tiles). Grids depend on shapes only and nothing is read back to the host, so a
decode step through it can be captured in a CUDA graph; kv_indices may be longer than
kv_indptr[B] uses.

Shapes: B rows, Hq heads, C latent dims, R rope dims, S pool slots, NS splits.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _mla_split_kernel(
    q_ptr, pool_ptr, indptr_ptr, indices_ptr, po_ptr, plse_ptr, out_ptr,
    scale_log2, s_qb, s_qh, s_ps, s_ob, s_oh,
    HQ: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    start = tl.load(indptr_ptr + b).to(tl.int64)
    length = tl.load(indptr_ptr + b + 1).to(tl.int64) - start
    chunk = tl.cdiv(length, NUM_SPLITS)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, length)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    h_ok = h < HQ
    c = tl.arange(0, BLOCK_C)  # [BC]
    c_ok = c < C
    r = tl.arange(0, BLOCK_R)  # [BR]
    r_ok = r < R
    qrow = q_ptr + b * s_qb + h[:, None] * s_qh
    q_c = tl.load(qrow + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)  # [BH, BC]
    q_r = tl.load(qrow + C + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if F32_DOT:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 domain)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)  # [BH, BC]
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BN]
        n_ok = n < hi
        slot = tl.load(indices_ptr + start + n, mask=n_ok, other=0).to(tl.int64)  # [BN]
        row = pool_ptr + slot[:, None] * s_ps
        k_c = tl.load(row + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)  # [BN, BC]
        k_r = tl.load(row + C + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        if F32_DOT:
            k_c = k_c.to(tl.float32)
            k_r = k_r.to(tl.float32)
        s = (tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
             + tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)) * scale_log2  # [BH, BN]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: the tile holds at least one key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BH, BN]
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision=PRECISION)
        m = m_new
    has = den > 0
    o = acc / tl.where(has, den, 1.0)[:, None]  # [BH, BC]
    tile = h_ok[:, None] & c_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * s_ob + h[:, None] * s_oh + c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=tile)
    else:
        prow = (b * HQ + h) * NUM_SPLITS + sp  # [BH] into [B, Hq, NS]
        tl.store(po_ptr + prow[:, None] * C + c[None, :], o, mask=tile)
        tl.store(plse_ptr + prow, tl.where(has, m + tl.log2(tl.where(has, den, 1.0)),
                                           float("-inf")), mask=h_ok)


@triton.jit
def _mla_merge_kernel(
    po_ptr, plse_ptr, out_ptr, s_ob, s_oh,
    HQ: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)  # [BS]
    sp_ok = sp < NUM_SPLITS
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    prow = (b * HQ + h) * NUM_SPLITS + sp  # [BS]
    lse = tl.load(plse_ptr + prow, mask=sp_ok, other=float("-inf"))  # split 0 is finite
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    po = tl.load(po_ptr + prow[:, None] * C + c[None, :], mask=sp_ok[:, None] & c_ok[None, :],
                 other=0.0)  # [BS, BC]
    o = tl.sum(po * w[:, None], 0)
    tl.store(out_ptr + b * s_ob + h * s_oh + c, o.to(out_ptr.dtype.element_ty), mask=c_ok)


def default_num_splits(batch: int, head_blocks: int, num_sms: int = 132) -> int:
    """Enough (row, head block, split) programs to cover the SMs about twice (H200: 132)."""
    want = triton.cdiv(2 * num_sms, max(1, batch * head_blocks))
    return int(min(32, max(1, triton.next_power_of_2(want))))


def mla_decode_attention(q_lat: Tensor, pool: Tensor, kv_indptr: Tensor, kv_indices: Tensor,
                         scale: float, c: int, out: Tensor | None = None,
                         num_splits: int | None = None) -> Tensor:
    """q_lat [B, Hq, C+R]; pool [S, 1, C+R] (or [S, C+R]); kv_indptr [B+1]; kv_indices
    [>= kv_indptr[B]]; `c` = C. Returns o_lat [B, Hq, C] in q's dtype (into `out` if given).
    Every row must have at least one key. A fixed `num_splits` keeps a captured graph valid
    for any context length (the default depends on B and Hq only)."""
    B, hq, dq = q_lat.shape
    pool2 = pool.reshape(pool.shape[0], -1)  # [S, C+R]
    if pool2.shape[1] != dq or not 0 < c < dq:
        raise ValueError(f"q_lat {tuple(q_lat.shape)} and pool {tuple(pool.shape)} do not "
                         f"form MLA latents of C={c}")
    if q_lat.stride(-1) != 1 or pool2.stride(-1) != 1:
        raise ValueError("the latent dim must be contiguous in q_lat and the pool")
    R = dq - c
    interp = _interpreting()
    # 16 heads a program: a [16, C] fp32 accumulator (C = 512: 32 registers a thread at 8
    # warps); DeepSeek-V3's 128 heads read each latent 8 times (once per head block)
    bh = 16
    hblocks = triton.cdiv(hq, bh)
    ns = num_splits or default_num_splits(B, hblocks)
    if out is None:
        out = torch.empty(B, hq, c, dtype=q_lat.dtype, device=q_lat.device)  # [B, Hq, C]
    if ns > 1:
        po = torch.empty(B, hq, ns, c, dtype=torch.float32, device=q_lat.device)
        plse = torch.empty(B, hq, ns, dtype=torch.float32, device=q_lat.device)
    else:
        po = plse = out  # unused
    f32 = interp or q_lat.dtype == torch.float32  # the interpreter's bf16 tl.dot is wrong
    prec = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    bc, br = triton.next_power_of_2(c), max(16, triton.next_power_of_2(R))
    _mla_split_kernel[(B, hblocks, ns)](
        q_lat, pool2, kv_indptr, kv_indices, po, plse, out,
        scale * _LOG2E, q_lat.stride(0), q_lat.stride(1), pool2.stride(0),
        out.stride(0), out.stride(1),
        HQ=hq, C=c, R=R, BLOCK_C=bc, BLOCK_R=br, BLOCK_H=bh,
        BLOCK_N=16 if interp else 32, NUM_SPLITS=ns, F32_DOT=f32, PRECISION=prec,
        num_warps=4 if interp else 8,
    )
    if ns > 1:
        _mla_merge_kernel[(B, hq)](
            po, plse, out, out.stride(0), out.stride(1),
            HQ=hq, C=c, BLOCK_C=bc, NUM_SPLITS=ns, BLOCK_S=max(2, triton.next_power_of_2(ns)),
            num_warps=4,
        )
    return out
