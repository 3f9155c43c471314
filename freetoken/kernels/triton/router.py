"""MoE router on the GPU: softmax, top-k and renormalisation fused into one Triton kernel.

Shape legend: T tokens, H hidden, E experts (<= 512 tested; any E that fits a program's
registers), K top-k (<= E).

    fused_router(x [T, H], weight [E, H], top_k, renormalize)
        -> (w [T, K] x.dtype, ids [T, K] int64)

The same function as `freetoken.layers.moe.Router.forward`. The logits stay one torch GEMM,
`F.linear(x, weight)` in x's dtype exactly as the Router computes them (cuBLAS, capturable):
computing them in fp32 inside the kernel would round differently from the bf16 logits the
Router takes its top-k of, and near-ties would then pick other experts. The kernel replaces the
rest (softmax in fp32, topk, sum, divide, cast: ~6 launches) with one launch and no host read,
so it can be captured in a CUDA graph. `router_topk(logits, ...)` is the kernel alone.

Selection is on the logits (in fp32), which softmax maps monotonically to the probabilities
torch.topk ranks, so the set is torch's without depending on how exactly `tl.exp` rounds (on the
GPU it is the hardware approximation, ~1e-6 relative: selecting on those probabilities would let
fp32 logits 1e-6 apart swap against torch's, about once per 10^4 routing decisions). Exact ties
go to the lowest expert id. Ties are common with bf16 logits (E=256, top-8: 3 rows of 37 had
two equal logits inside the top 8), and torch.topk leaves their order unspecified (on the CPU:
[2, 4, 1] for three equal values, higher-id-first in those bf16 rows). Inside the top K a tie
only permutes (id, weight) pairs of equal weight, which changes nothing downstream but the order
of the weighted sum; a tie across the K-th place picks the lower id here, maybe not in torch.
So does a tie torch's probabilities make where the logits differ (both underflowed to 0).
Ids come out in descending weight order; a weight may differ from torch's in the last fp32 bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


@triton.jit(do_not_specialize=["T"])  # sizes/indices: 1 compile
def _router_topk_kernel(
    logits_ptr, w_ptr, ids_ptr, mask_ptr,
    T, E, stride_lt,
    TOPK: tl.constexpr, RENORM: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    e = tl.arange(0, BLOCK_E)  # [BE]
    kk = tl.arange(0, BLOCK_K)  # [BK]
    t_ok = t < T
    ptrs = logits_ptr + t[:, None].to(tl.int64) * stride_lt + e[None, :]
    lg = tl.load(ptrs, mask=t_ok[:, None] & (e[None, :] < E), other=float("-inf"))
    lg = tl.where(t_ok[:, None], lg.to(tl.float32), 0.0)  # [BT, BE]; no all -inf padding rows
    m = tl.max(lg, axis=1)  # [BT]
    s = tl.sum(tl.exp(lg - m[:, None]), axis=1)  # [BT] softmax denominator; padding adds 0
    avail = (e[None, :] < E) & t_ok[:, None]  # [BT, BE] real experts not yet picked
    sel_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    sel_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for k in tl.static_range(TOPK):
        best = tl.max(tl.where(avail, lg, float("-inf")), axis=1)  # [BT]
        hit = avail & (lg == best[:, None])
        idx = tl.min(tl.where(hit, e[None, :], BLOCK_E), axis=1)  # [BT] lowest id of a tie
        p = tl.exp(best - m) / s  # [BT] the softmax probability of the pick, fp32
        sel_w = tl.where(kk[None, :] == k, p[:, None], sel_w)
        sel_i = tl.where(kk[None, :] == k, idx[:, None].to(tl.int64), sel_i)
        avail = avail & (e[None, :] != idx[:, None])
    if RENORM:
        # the top pick has p > 0 in a real row; padding rows (all p = 0) divide by 1
        sel_w = sel_w / tl.where(t_ok, tl.sum(sel_w, axis=1), 1.0)[:, None]
    if HAS_MASK:  # rows outside the mask (a graph bucket's padding) route nowhere
        keep = tl.load(mask_ptr + t, mask=t_ok, other=0) != 0  # [BT]
        sel_i = tl.where(keep[:, None], sel_i, -1)
    out = t[:, None].to(tl.int64) * TOPK + kk[None, :]  # [BT, BK]
    ok = t_ok[:, None] & (kk[None, :] < TOPK)
    tl.store(w_ptr + out, sel_w.to(w_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, sel_i, mask=ok)


def router_topk(logits: Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype,
                row_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """logits [T, E] (any float dtype) -> (w [T, K] out_dtype, ids [T, K] int64). Rows where
    `row_mask` [T] (bool) is False get ids -1 (their weights are still computed)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, E] with a contiguous last dim, got {logits.shape}")
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in [1, E={E}]")
    w = torch.empty((T, top_k), dtype=out_dtype, device=logits.device)  # [T, K]
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)  # [T, K]
    if T == 0:
        return w, ids
    if row_mask is not None and (row_mask.shape != (T,) or row_mask.dtype != torch.bool):
        raise ValueError(f"row_mask must be bool [T={T}], got {row_mask.dtype} "
                         f"{tuple(row_mask.shape)}")
    block_e = max(16, triton.next_power_of_2(E))
    # a program keeps a few BLOCK_T x BLOCK_E fp32 arrays live: 4k values each at 4 warps. Not
    # sized from T: each BLOCK_T is a compile, and a decode row more or less costs nothing
    block_t = max(1, min(16, 4096 // block_e))
    _router_topk_kernel[(triton.cdiv(T, block_t),)](
        logits, w, ids, row_mask if row_mask is not None else ids, T, E, logits.stride(0),
        TOPK=top_k, RENORM=bool(renormalize), HAS_MASK=row_mask is not None,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        num_warps=4,
    )
    return w, ids


def fused_router(x: Tensor, weight: Tensor, top_k: int, renormalize: bool,
                 row_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Router.forward: x [T, H], weight [E, H] -> (w [T, K] x.dtype, ids [T, K] int64), ids -1
    on rows outside `row_mask` [T] bool."""
    logits = F.linear(x, weight)  # [T, E] in x.dtype, as the Router
    return router_topk(logits, top_k, renormalize, x.dtype, row_mask)
