"""The grouped (prefill) fused MoE path over quantized banks: moe_grouped.py's sorted-entry
tl.dot GEMMs, each weight tile dequantized in the kernel (moe_quant.py's `_wtile`: FP8 e4m3
block-scaled or MXFP4, fp32 values) and cast to x's dtype for the dot (bf16 tensor cores on the
GPU; fp32 "ieee" dots for fp32, the test oracle's precision).

    fused_moe_quant_grouped(x [T, H], ids [T, K], gate_up QuantBank [S, 2I, H],
                            down QuantBank [S, H, I], y [T, K, H]) -> y

Entries with ids < 0 are not written (the caller zeroes y first when it needs zeros). Each
expert's codes are read once per row block of its entries, as in the dense grouped path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken.kernels.expert_act import ExpertAct, act_code
from freetoken.kernels.quant import QuantBank
from freetoken.kernels.triton.moe_common import _bias_down_2d, _bias_gu_2d, _block, _glu, act_args
from freetoken.kernels.triton.moe_grouped import _tile_ids, grouped_setup
from freetoken.kernels.triton.moe_quant import _check, _operands, _wtile


@triton.jit(do_not_specialize=["N", "P"])  # sizes/indices: 1 compile
def _qg_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, a_ptr, sorted_ptr, block_row_ptr, total_ptr, lid_ptr, gub_ptr,
    N, P, H, I, TOPK, NB, alpha, limit,
    stride_xt, stride_we, stride_wr, stride_se, stride_sr, stride_an, stride_gub,
    FMT: tl.constexpr, QB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, ACT: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), P, I, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    row = tl.load(block_row_ptr + pid_m).to(tl.int64)
    ent = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    ent_ok = ent < N
    tok = ent // TOPK
    i = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    i_ok = i < I
    kk = tl.arange(0, BLOCK_K)
    w = w_ptr + row * stride_we
    s = s_ptr + row * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        xa = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :],
                     mask=ent_ok[:, None] & (k < H)[None, :], other=0.0)  # [BM, BK]
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong (MODEL_FACTS §3)
            xa = xa.to(tl.float32)
        g = _wtile(w, s, i, i // QB, k, i_ok, H, stride_wr, stride_sr, FMT, QB)  # [BN, BK]
        u = _wtile(w, s, I + i, NB + i // QB, k, i_ok, H, stride_wr, stride_sr, FMT, QB)
        acc_g = tl.dot(xa, tl.trans(g).to(xa.dtype), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(xa, tl.trans(u).to(xa.dtype), acc_u, input_precision=PRECISION)
    if ACT == 1:  # gpt-oss: biases by logical id
        acc_g, acc_u = _bias_gu_2d(acc_g, acc_u, lid_ptr, gub_ptr, ent, ent_ok, i, i_ok, I,
                                   stride_gub)
    act = _glu(acc_g, acc_u, alpha, limit, ACT)  # [BM, BN]
    tl.store(a_ptr + ent[:, None] * stride_an + i[None, :], act.to(a_ptr.dtype.element_ty),
             mask=ent_ok[:, None] & i_ok[None, :])


@triton.jit(do_not_specialize=["N", "P"])  # sizes/indices: 1 compile
def _qg_down_kernel(
    a_ptr, w_ptr, s_ptr, y_ptr, sorted_ptr, block_row_ptr, total_ptr, lid_ptr, db_ptr,
    N, P, H, I, TOPK,
    stride_an, stride_we, stride_wr, stride_se, stride_sr, stride_yt, stride_yk, stride_yh,
    stride_db,
    FMT: tl.constexpr, QB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, ACT: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), P, H, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    row = tl.load(block_row_ptr + pid_m).to(tl.int64)
    ent = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    ent_ok = ent < N
    h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    h_ok = h < H
    kk = tl.arange(0, BLOCK_K)
    w = w_ptr + row * stride_we
    s = s_ptr + row * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        av = tl.load(a_ptr + ent[:, None] * stride_an + k[None, :],
                     mask=ent_ok[:, None] & (k < I)[None, :], other=0.0)  # [BM, BK]
        if UPCAST:
            av = av.to(tl.float32)
        wt = _wtile(w, s, h, h // QB, k, h_ok, I, stride_wr, stride_sr, FMT, QB)  # [BN, BK]
        acc = tl.dot(av, tl.trans(wt).to(av.dtype), acc, input_precision=PRECISION)
    if ACT == 1:  # gpt-oss: biases by logical id
        acc = _bias_down_2d(acc, lid_ptr, db_ptr, ent, ent_ok, h, h_ok, stride_db)
    y_ptrs = (y_ptr + (ent // TOPK)[:, None] * stride_yt + (ent % TOPK)[:, None] * stride_yk
              + h[None, :] * stride_yh)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ent_ok[:, None] & h_ok[None, :])


def fused_moe_quant_grouped(x: Tensor, ids: Tensor, gate_up: QuantBank, down: QuantBank,
                            y: Tensor, config: tuple[dict, dict] | None = None, *,
                            act: ExpertAct | None = None) -> Tensor:
    """See the module docstring. `config` = (gate_up cfg, down cfg) as moe_grouped's.
    `act`: gpt-oss's biases (by the entries' logical ids) and clamped SwiGLU, or
    DeepSeek-V4's clamp."""
    T, K, H, I, fmt, qb = _check(x, ids, gate_up, down, y)
    N, S = T * K, gate_up.shape[0]
    if N == 0:
        return y
    cu, cd, upcast, prec, bm, sorted_entries, block_row, total = grouped_setup(x, ids, S, config)
    P = sorted_entries.numel()
    gd, gs, dd, ds = _operands(gate_up, down)
    lid, gub, db, alpha, limit, s_gub, s_db = act_args(act, x, N)
    a = torch.empty((N, I), dtype=x.dtype, device=x.device)  # [N, I] SwiGLU output
    bn, bk = _block(cu["BLOCK_N"], I, 16), _block(cu["BLOCK_K"], H, 16)
    _qg_gate_up_kernel[(triton.cdiv(P, bm) * triton.cdiv(I, bn),)](
        x, gd, gs, a, sorted_entries, block_row, total, lid, gub, N, P, H, I, K,
        triton.cdiv(I, qb), alpha, limit,
        x.stride(0), gd.stride(0), gd.stride(1), gs.stride(0), gs.stride(1), a.stride(0), s_gub,
        FMT=fmt, QB=qb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cu["GROUP_M"],
        UPCAST=upcast, PRECISION=prec, ACT=act_code(act),
        num_warps=cu["num_warps"], num_stages=cu["num_stages"])
    bn, bk = _block(cd["BLOCK_N"], H, 16), _block(cd["BLOCK_K"], I, 16)
    _qg_down_kernel[(triton.cdiv(P, bm) * triton.cdiv(H, bn),)](
        a, dd, ds, y, sorted_entries, block_row, total, lid, db, N, P, H, I, K,
        a.stride(0), dd.stride(0), dd.stride(1), ds.stride(0), ds.stride(1),
        y.stride(0), y.stride(1), y.stride(2), s_db,
        FMT=fmt, QB=qb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cd["GROUP_M"],
        UPCAST=upcast, PRECISION=prec, ACT=act_code(act),
        num_warps=cd["num_warps"], num_stages=cd["num_stages"])
    return y
