"""Paged GQA attention over the KV pool in place (page size 1): split-K decode and causal prefill.

Pool layout (`freetoken.cache.tensors.KVPool`): k_pool, v_pool [S, Hk, D], one slot per
token. Sequence b's keys sit at slots kv_indices[kv_indptr[b]:kv_indptr[b+1]] (CSR, int32 or
int64), oldest first. Query head h reads KV head h // G, G = Hq / Hk (repeat_interleave order,
as SDPA's enable_gqa). Shapes: B sequences, T packed new tokens, NS splits, D head dim.

Every launch grid depends on shapes only and no value is read back to the host, so both
functions can be captured in a CUDA graph; `kv_indices` may be a larger preallocated buffer than
kv_indptr[B] uses (entries past it are never read).

Decode is flash-decoding: program (b, kv head, split) walks its share of b's keys once for all G
query heads of that KV head (so each K/V row is read once), keeping a running max and sum in
fp32; a second kernel merges the NS partial results by their log-sum-exp. Empty splits (a
sequence shorter than NS) write lse = -inf and weigh nothing in the merge.
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


def _dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast both dot operands to fp32, input precision). The interpreter computes bf16/fp16
    tl.dot wrongly, so it upcasts; fp32 on the GPU asks for IEEE products, not tf32."""
    f32 = _interpreting() or dtype == torch.float32
    return f32, "ieee" if dtype == torch.float32 else "tf32"


def default_num_splits(batch: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Enough (b, kv head, split) programs to cover the SMs about twice (H200: 132 SMs)."""
    want = triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads))
    return int(min(64, max(1, triton.next_power_of_2(want))))


@triton.jit
def split_attend(q_ptr, k_ptr, v_ptr, indices_ptr, b, kh, start, lo, hi, scale_log2,
                 s_qb, s_qh, s_ks, s_kh, s_vs, s_vh,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One split's pass (the decode kernels' shared body, inlined): the G query heads of KV
    head `kh` of row `b` over its keys lo..hi (CSR positions after `start`), a running max and
    sum in fp32 in the log2 domain. Returns (o [BG, D] normalised, m [BG], den [BG], qh [BG]
    query heads, g_ok [BG]); den == 0 where the split held no key."""
    g = tl.arange(0, BLOCK_G)  # [BG] query heads of this KV head (padded to a dot tile)
    d = tl.arange(0, D)  # [D]
    g_ok = g < G
    qh = kh * G + g  # [BG]
    q = tl.load(q_ptr + b * s_qb + qh[:, None] * s_qh + d[None, :], mask=g_ok[:, None],
                other=0.0)  # [BG, D]
    if F32_DOT:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (log2 domain)
    den = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_G, D], tl.float32)  # [BG, D]
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BN]
        n_ok = n < hi
        slot = tl.load(indices_ptr + start + n, mask=n_ok, other=0).to(tl.int64)  # [BN]
        k = tl.load(k_ptr + slot[:, None] * s_ks + kh * s_kh + d[None, :], mask=n_ok[:, None],
                    other=0.0)  # [BN, D]
        v = tl.load(v_ptr + slot[:, None] * s_vs + kh * s_vh + d[None, :], mask=n_ok[:, None],
                    other=0.0)  # [BN, D]
        if F32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BG, BN]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: the tile holds at least one key
        alpha = tl.exp2(m - m_new)  # [BG]
        p = tl.exp2(s - m_new[:, None])  # [BG, BN]
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    o = acc / tl.where(den > 0, den, 1.0)[:, None]  # [BG, D]
    return o, m, den, qh, g_ok


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, po_ptr, plse_ptr, out_ptr,
    scale_log2,
    s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, s_ob, s_oh,
    HQ: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, F32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    start = tl.load(indptr_ptr + b).to(tl.int64)
    length = tl.load(indptr_ptr + b + 1).to(tl.int64) - start
    chunk = tl.cdiv(length, NUM_SPLITS)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, length)
    o, m, den, qh, g_ok = split_attend(q_ptr, k_ptr, v_ptr, indices_ptr, b, kh, start, lo, hi,
                                       scale_log2, s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, G,
                                       BLOCK_G, D, BLOCK_N, F32_DOT, PRECISION)
    d = tl.arange(0, D)  # [D]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * s_ob + qh[:, None] * s_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        has = den > 0
        row = (b * HQ + qh) * NUM_SPLITS + sp  # [BG] into [B, Hq, NS]
        tl.store(po_ptr + row[:, None] * D + d[None, :], o, mask=g_ok[:, None])
        tl.store(plse_ptr + row, tl.where(has, m + tl.log2(tl.where(has, den, 1.0)),
                                          float("-inf")), mask=g_ok)


@triton.jit
def _decode_merge_kernel(
    po_ptr, plse_ptr, out_ptr, s_ob, s_oh,
    HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)  # [BS]
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, D)
    row = (b * HQ + h) * NUM_SPLITS + sp  # [BS]
    lse = tl.load(plse_ptr + row, mask=sp_ok, other=float("-inf"))  # [BS], split 0 is finite
    w = tl.exp2(lse - tl.max(lse, 0))  # [BS]
    w = w / tl.sum(w, 0)
    po = tl.load(po_ptr + row[:, None] * D + d[None, :], mask=sp_ok[:, None], other=0.0)
    o = tl.sum(po * w[:, None], 0)  # [D]
    tl.store(out_ptr + b * s_ob + h * s_oh + d, o.to(out_ptr.dtype.element_ty))


def _check(q: Tensor, k_pool: Tensor, v_pool: Tensor) -> tuple[int, int, int]:
    hq, d = q.shape[-2:]
    hk = k_pool.shape[1]
    if hq % hk or k_pool.shape != v_pool.shape or k_pool.shape[2] != d:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k_pool.shape)}, "
                         f"v {tuple(v_pool.shape)} do not form GQA over [S, Hk, D]")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("the head dim must be contiguous in q and the pools")
    return hq, hk, d


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_indptr: Tensor,
                           kv_indices: Tensor, scale: float, out: Tensor | None = None,
                           num_splits: int | None = None) -> Tensor:
    """One query token per sequence. q [B, Hq, D]; k_pool, v_pool [S, Hk, D]; kv_indptr [B+1];
    kv_indices [>= kv_indptr[B]]. Returns out [B, Hq, D] in q's dtype (written into `out` if
    given). `num_splits` defaults to `default_num_splits(B, Hk)`; a fixed value keeps the graph
    valid for any context length. Every sequence must have at least one key."""
    hq, hk, d = _check(q, k_pool, v_pool)
    B = q.shape[0]
    ns = num_splits or default_num_splits(B, hk)
    if out is None:
        out = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)  # [B, Hq, D]
    if ns > 1:
        po = torch.empty(B, hq, ns, d, dtype=torch.float32, device=q.device)  # [B, Hq, NS, D]
        plse = torch.empty(B, hq, ns, dtype=torch.float32, device=q.device)  # [B, Hq, NS]
    else:
        po = plse = out  # unused
    f32, prec = _dot_mode(q.dtype)
    G = hq // hk
    _decode_split_kernel[(B, hk, ns)](
        q, k_pool, v_pool, kv_indptr, kv_indices, po, plse, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
        HQ=hq, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=d,
        BLOCK_N=16 if _interpreting() else (32 if d >= 256 else 64), NUM_SPLITS=ns,
        F32_DOT=f32, PRECISION=prec, num_warps=4,
    )
    if ns > 1:
        _decode_merge_kernel[(B, hq)](
            po, plse, out, out.stride(0), out.stride(1),
            HQ=hq, D=d, NUM_SPLITS=ns, BLOCK_S=max(2, triton.next_power_of_2(ns)), num_warps=4,
        )
    return out


@triton.jit(do_not_specialize=["B"])  # sizes/indices: 1 compile
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, qo_indptr_ptr, kv_indptr_ptr, indices_ptr, out_ptr,
    scale_log2, B,
    s_qt, s_qh, s_ks, s_kh, s_vs, s_vh, s_ot, s_oh,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // G
    # Which sequence and query block is this program? The grid has cdiv(T, BM) + B programs,
    # enough for every sequence's ceil(n_b / BM) blocks; the spare ones find nothing and idle.
    seq = pid * 0 - 1
    blk = pid * 0
    before = pid * 0
    for bb in range(B):
        n_bb = (tl.load(qo_indptr_ptr + bb + 1) - tl.load(qo_indptr_ptr + bb)).to(tl.int32)
        nb = tl.cdiv(n_bb, BLOCK_M)
        mine = (pid >= before) & (pid < before + nb)
        seq = tl.where(mine, bb, seq)
        blk = tl.where(mine, pid - before, blk)
        before += nb
    valid = seq >= 0
    b = tl.maximum(seq, 0)
    qs = tl.load(qo_indptr_ptr + b).to(tl.int64)
    n_new = tl.where(valid, tl.load(qo_indptr_ptr + b + 1).to(tl.int64) - qs, 0)
    ks = tl.load(kv_indptr_ptr + b).to(tl.int64)
    length = tl.load(kv_indptr_ptr + b + 1).to(tl.int64) - ks

    i = blk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] query index within b's new tokens
    i_ok = i < n_new
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (qs + i)[:, None] * s_qt + h * s_qh + d[None, :], mask=i_ok[:, None],
                other=0.0)  # [BM, D]
    if F32_DOT:
        q = q.to(tl.float32)
    limit = length - n_new + i  # [BM] last key each query sees
    hi = tl.where(valid, tl.minimum(length, length - n_new + blk * BLOCK_M + BLOCK_M), 0)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: padded rows see no key at all
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BN]
        n_ok = n < hi
        slot = tl.load(indices_ptr + ks + n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * s_ks + kh * s_kh + d[None, :], mask=n_ok[:, None],
                    other=0.0)  # [BN, D]
        v = tl.load(v_ptr + slot[:, None] * s_vs + kh * s_vh + d[None, :], mask=n_ok[:, None],
                    other=0.0)  # [BN, D]
        if F32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BM, BN]
        s = tl.where(n_ok[None, :] & (n[None, :] <= limit[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + (qs + i)[:, None] * s_ot + h * s_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=i_ok[:, None])


def paged_prefill_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, qo_indptr: Tensor,
                            kv_indptr: Tensor, kv_indices: Tensor, scale: float) -> Tensor:
    """Causal attention for packed new tokens whose K/V are already in the pool.
    q [T, Hq, D]; qo_indptr [B+1] packed rows of each sequence's n_b new tokens; kv_indptr
    [B+1] and kv_indices as in decode, L_b = kv length >= n_b. Query i of sequence b sees its
    keys 0 .. L_b - n_b + i. Returns [T, Hq, D] in q's dtype."""
    hq, hk, d = _check(q, k_pool, v_pool)
    T = q.shape[0]
    B = qo_indptr.shape[0] - 1
    out = torch.empty(T, hq, d, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    interp = _interpreting()
    bm = 16 if interp else 64
    f32, prec = _dot_mode(q.dtype)
    _prefill_kernel[(triton.cdiv(T, bm) + B, hq)](
        q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, out,
        scale * _LOG2E, B,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
        G=hq // hk, D=d, BLOCK_M=bm, BLOCK_N=16 if interp else (32 if d >= 256 else 64),
        F32_DOT=f32, PRECISION=prec, num_warps=4 if interp or d < 256 else 8,
    )
    return out
