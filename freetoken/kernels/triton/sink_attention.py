"""Paged decode attention with attention sinks and a sliding window (gpt-oss), split-K.

Pool layout as `paged_attention.py`: k_pool, v_pool [S, Hk, D], one slot per token; row b's keys
sit at slots kv_indices[kv_indptr[b]:kv_indptr[b+1]] (CSR, int32 or int64), oldest first, its
new token's K/V written last. Query head h reads KV head h // G, G = Hq / Hk.

The sink is one more logit per query head that attends to nothing (transformers'
`eager_attention_forward` for gpt-oss):

    o_h = Σ_j exp(s_j) v_j / (Σ_j exp(s_j) + exp(sink_h)),   s_j = q_h · k_j * scale

With `window` W > 0 the row's query (at position L-1) reads only its last W keys (positions
j > L-1-W, transformers' sliding-window mask); W = 0 reads every key. The CSR always lists the
whole context (the radix cache keeps every layer's K/V); the window is cut in the kernel, so a
sliding layer's decode cost does not grow with the context.

Program (b, kv head, split) walks its share of the readable keys once for all G query heads of
that KV head with a running max and sum in fp32 (log2 domain: `paged_attention.split_attend`,
the pass both decode kernels share) and writes its partial output and log-sum-exp; the merge
kernel adds the sink to the denominator while merging the NS partials:
o = Σ_s exp2(lse_s - M) o_s / (Σ_s exp2(lse_s - M) + exp2(sink·log2e - M)). Empty splits write
lse = -inf and weigh nothing. Launch grids depend on shapes only and nothing is read back to the
host, so the function can be captured in a CUDA graph (a fixed `num_splits` keeps the graph
valid for any context length; the window is a runtime integer, not specialised).

Shapes: B rows, Hq / Hk heads, D head dim (a power of two >= 16), NS splits, S pool slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken.kernels.triton.paged_attention import (
    _LOG2E,
    _check,
    _dot_mode,
    _interpreting,
    default_num_splits,
    split_attend,
)


@triton.jit(do_not_specialize=["window"])
def _sink_split_kernel(
    q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, po_ptr, plse_ptr,
    scale_log2, window,
    s_qb, s_qh, s_ks, s_kh, s_vs, s_vh,
    HQ: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, F32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    start = tl.load(indptr_ptr + b).to(tl.int64)
    length = tl.load(indptr_ptr + b + 1).to(tl.int64) - start
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # oldest readable key
    chunk = tl.cdiv(length - first, NUM_SPLITS)
    lo = first + sp * chunk
    hi = tl.minimum(lo + chunk, length)

    o, m, den, qh, g_ok = split_attend(q_ptr, k_ptr, v_ptr, indices_ptr, b, kh, start, lo, hi,
                                       scale_log2, s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, G,
                                       BLOCK_G, D, BLOCK_N, F32_DOT, PRECISION)
    d = tl.arange(0, D)  # [D]
    has = den > 0
    row = (b * HQ + qh) * NUM_SPLITS + sp  # [BG] into [B, Hq, NS]
    tl.store(po_ptr + row[:, None] * D + d[None, :], o, mask=g_ok[:, None])
    tl.store(plse_ptr + row, tl.where(has, m + tl.log2(tl.where(has, den, 1.0)),
                                      float("-inf")), mask=g_ok)


@triton.jit
def _sink_merge_kernel(
    po_ptr, plse_ptr, sinks_ptr, out_ptr, s_ob, s_oh,
    HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)  # [BS]
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, D)
    row = (b * HQ + h) * NUM_SPLITS + sp  # [BS]
    lse = tl.load(plse_ptr + row, mask=sp_ok, other=float("-inf"))  # [BS] (log2 domain)
    sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # log2 domain
    top = tl.maximum(tl.max(lse, 0), sink)  # finite: the sink is
    w = tl.exp2(lse - top)  # [BS]
    den = tl.sum(w, 0) + tl.exp2(sink - top)
    po = tl.load(po_ptr + row[:, None] * D + d[None, :], mask=sp_ok[:, None], other=0.0)
    o = tl.sum(po * w[:, None], 0) / den  # [D]
    tl.store(out_ptr + b * s_ob + h * s_oh + d, o.to(out_ptr.dtype.element_ty))


def sink_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, kv_indptr: Tensor,
                          kv_indices: Tensor, scale: float, sinks: Tensor, window: int = 0,
                          out: Tensor | None = None, num_splits: int | None = None) -> Tensor:
    """One query token per row with a sink logit per head and an optional sliding window.
    q [B, Hq, D]; k_pool, v_pool [S, Hk, D]; kv_indptr [B+1]; kv_indices [>= kv_indptr[B]];
    sinks [Hq] (any float dtype, natural-log units like the scores); window >= 0 (0: every key).
    Returns out [B, Hq, D] in q's dtype (written into `out` if given). Every row must have at
    least one key. `num_splits` defaults to `default_num_splits(B, Hk)`."""
    hq, hk, d = _check(q, k_pool, v_pool)
    if sinks.shape != (hq,):
        raise ValueError(f"sinks {tuple(sinks.shape)} must be [Hq] = [{hq}]")
    if window < 0:
        raise ValueError(f"window {window} must be >= 0")
    B = q.shape[0]
    ns = num_splits or default_num_splits(B, hk)
    if out is None:
        out = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)  # [B, Hq, D]
    po = torch.empty(B, hq, ns, d, dtype=torch.float32, device=q.device)  # [B, Hq, NS, D]
    plse = torch.empty(B, hq, ns, dtype=torch.float32, device=q.device)  # [B, Hq, NS]
    f32, prec = _dot_mode(q.dtype)
    G = hq // hk
    _sink_split_kernel[(B, hk, ns)](
        q, k_pool, v_pool, kv_indptr, kv_indices, po, plse,
        scale * _LOG2E, window,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1),
        HQ=hq, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=d,
        BLOCK_N=16 if _interpreting() else (32 if d >= 256 else 64), NUM_SPLITS=ns,
        F32_DOT=f32, PRECISION=prec, num_warps=4,
    )
    _sink_merge_kernel[(B, hq)](
        po, plse, sinks, out, out.stride(0), out.stride(1),
        HQ=hq, D=d, NUM_SPLITS=ns, BLOCK_S=max(2, triton.next_power_of_2(ns)), num_warps=4,
    )
    return out
