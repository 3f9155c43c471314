"""The fused MoE decode path over quantized banks (freetoken/kernels/quant.py): FP8 e4m3 with B x B
block scales and MXFP4 (e2m1 codes two a byte, e8m0 scale per 32), dequantized in the kernel.

Shape legend as in fused_moe.py: T tokens, K top-k, H hidden, I expert intermediate, S bank
rows, N = T*K entries.

    fused_moe_quant_decode(x [T, H], ids [T, K], gate_up QuantBank [S, 2I, H],
                           down QuantBank [S, H, I], y [T, K, H]) -> y

The contract of `fused_moe.fused_moe_decode` (unweighted outputs, ids < 0 keep y's value or get
zeros with `zero_missing`), in the same two GEMV launches per step (gate_up + SiLU*up into an
fp32 [N, I], then down), capturable. The weights stay in their format in memory: each program
loads its [BLOCK_N, BLOCK_K] tile of codes (FP8 bytes as uint8: the bits are decoded in
registers, which the interpreter runs too) and its scales, and accumulates in fp32 — MXFP4 is
weight-only dequant (H200 has no FP4 tensor cores); FP8 is dequantized the same way here (FP8
dots are a later step). Larger batches take `fused_moe_quant_grouped`
(freetoken/kernels/triton/moe_quant_grouped.py): the grouped tl.dot path over the same tiles. Both
take `act=` (gpt-oss's biases by logical id and clamped SwiGLU, or DeepSeek-V4's clamp) in the
ACT constexpr's epilogues, as fused_moe.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken.kernels.expert_act import ExpertAct, act_code
from freetoken.kernels.quant import MX_BLOCK, QuantBank
from freetoken.kernels.triton.fused_moe import DECODE_CONFIG, DECODE_MAX_ENTRIES  # noqa: F401
from freetoken.kernels.triton.moe_common import _block, _glu, act_args

FMT_CODES = {"fp8": 0, "mxfp4": 1}


@triton.jit
def _wtile(w_ptr, s_ptr, rows, srow, k, row_ok, ncols, stride_wr, stride_sr,
           FMT: tl.constexpr, QB: tl.constexpr):
    """fp32 [BN, BK] weights of `rows` x columns `k` of one expert; `srow`: each row's fp8
    scale-grid row (FMT 0) — MXFP4 scales are per row."""
    m = row_ok[:, None] & (k[None, :] < ncols)
    if FMT == 0:
        b = tl.load(w_ptr + rows[:, None] * stride_wr + k[None, :], mask=m, other=0).to(tl.int32)
        e = (b >> 3) & 15
        man = (b & 7).to(tl.float32)
        mag = tl.where(e == 0, man * 0.001953125,  # subnormal: m / 8 * 2^-6
                       (1.0 + man * 0.125) * tl.exp2((e - 7).to(tl.float32)))
        val = tl.where(b >= 128, -mag, mag)
        s = tl.load(s_ptr + srow[:, None] * stride_sr + (k // QB)[None, :], mask=m, other=0.0)
    else:
        b = tl.load(w_ptr + rows[:, None] * stride_wr + (k // 2)[None, :], mask=m,
                    other=0).to(tl.int32)
        code = (b >> ((k % 2) * 4)[None, :]) & 15
        e = (code >> 1) & 3
        man = (code & 1).to(tl.float32)
        mag = tl.where(e == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        val = tl.where(code >= 8, -mag, mag)
        sc = tl.load(s_ptr + rows[:, None] * stride_sr + (k // 32)[None, :], mask=m, other=127)
        s = tl.exp2(sc.to(tl.float32) - 127.0)
    return val * s


@triton.jit
def _q_gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, s_ptr, a_ptr, lid_ptr, gub_ptr, H, I, TOPK, NB, alpha, limit,
    stride_xt, stride_we, stride_wr, stride_se, stride_sr, stride_an, stride_gub,
    FMT: tl.constexpr, QB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT: tl.constexpr,
):
    """a[n, i] = silu(gate[id] @ x[t])[i] * (up[id] @ x[t])[i], BLOCK_N rows i of entry n;
    ACT selects `_glu`; ACT 1 (gpt-oss) adds gate_up_bias[lid[n]] (the logical expert) first."""
    n = tl.program_id(0)
    row = tl.load(ids_ptr + n).to(tl.int64)
    if row < 0:
        return
    i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ok = i < I
    kk = tl.arange(0, BLOCK_K)
    w = w_ptr + row * stride_we
    s = s_ptr + row * stride_se
    x_row = x_ptr + (n // TOPK).to(tl.int64) * stride_xt
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        xv = tl.load(x_row + k, mask=k < H, other=0.0).to(tl.float32)  # [BK]
        g = _wtile(w, s, i, i // QB, k, ok, H, stride_wr, stride_sr, FMT, QB)
        u = _wtile(w, s, I + i, NB + i // QB, k, ok, H, stride_wr, stride_sr, FMT, QB)
        acc_g += g * xv[None, :]
        acc_u += u * xv[None, :]
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if ACT == 1:  # gpt-oss: biases by logical id
        gb = gub_ptr + tl.load(lid_ptr + n).to(tl.int64) * stride_gub + i  # [BN]
        gate += tl.load(gb, mask=ok, other=0.0).to(tl.float32)
        up += tl.load(gb + I, mask=ok, other=0.0).to(tl.float32)
    tl.store(a_ptr + n.to(tl.int64) * stride_an + i, _glu(gate, up, alpha, limit, ACT),
             mask=ok)


@triton.jit
def _q_down_kernel(
    a_ptr, ids_ptr, w_ptr, s_ptr, y_ptr, lid_ptr, db_ptr, H, I, TOPK,
    stride_an, stride_we, stride_wr, stride_se, stride_sr, stride_yt, stride_yk, stride_yh,
    stride_db,
    ZERO_MISSING: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
):
    """y[t, k, h] = down[id][h] @ a[n] (+ down_bias[lid[n]] under ACT 1) for entry
    n = t*K + k and BLOCK_N rows h."""
    n = tl.program_id(0)
    row = tl.load(ids_ptr + n).to(tl.int64)
    h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ok = h < H
    y_ptrs = y_ptr + (n // TOPK).to(tl.int64) * stride_yt + (n % TOPK) * stride_yk + h * stride_yh
    if row < 0:
        if ZERO_MISSING:
            tl.store(y_ptrs, tl.zeros([BLOCK_N], dtype=tl.float32).to(y_ptr.dtype.element_ty),
                     mask=ok)
        return
    kk = tl.arange(0, BLOCK_K)
    w = w_ptr + row * stride_we
    s = s_ptr + row * stride_se
    a_row = a_ptr + n.to(tl.int64) * stride_an
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        av = tl.load(a_row + k, mask=k < I, other=0.0)
        acc += _wtile(w, s, h, h // QB, k, ok, I, stride_wr, stride_sr, FMT, QB) * av[None, :]
    out = tl.sum(acc, axis=1)  # [BN]
    if ACT == 1:  # gpt-oss: biases by logical id
        db = db_ptr + tl.load(lid_ptr + n).to(tl.int64) * stride_db + h  # [BN]
        out += tl.load(db, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=ok)


def _check(x: Tensor, ids: Tensor, gate_up: QuantBank, down: QuantBank, y: Tensor
           ) -> tuple[int, int, int, int, int, int]:
    """Validate; returns (T, K, H, I, format code, columns per scale)."""
    T, H = x.shape
    K = ids.shape[1]
    S, two_i, _ = gate_up.shape
    I = two_i // 2
    if (gate_up.fmt, gate_up.block) != (down.fmt, down.block) or gate_up.halves != 2:
        raise ValueError("gate_up (halves=2) and down need one format")
    if tuple(down.shape) != (S, H, I) or tuple(y.shape) != (T, K, H) or x.stride(1) != 1:
        raise ValueError(f"shape mismatch: x={tuple(x.shape)} ids={tuple(ids.shape)} "
                         f"gate_up={tuple(gate_up.shape)} down={tuple(down.shape)}")
    fmt = FMT_CODES[gate_up.fmt]
    return T, K, H, I, fmt, gate_up.block if fmt == 0 else MX_BLOCK


def _operands(gate_up: QuantBank, down: QuantBank) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(gate_up codes, scales, down codes, scales); e4m3 bytes as uint8 (decoded in-kernel)."""
    gd, dd = gate_up.data, down.data
    if gate_up.fmt == "fp8":
        gd, dd = gd.view(torch.uint8), dd.view(torch.uint8)
    return gd, gate_up.scale, dd, down.scale


def fused_moe_quant_decode(x: Tensor, ids: Tensor, gate_up: QuantBank, down: QuantBank,
                           y: Tensor, config: dict | None = None, *,
                           zero_missing: bool = False, act: ExpertAct | None = None) -> Tensor:
    """See the module docstring. `config` overrides DECODE_CONFIG's tiles (same keys).
    `act`: gpt-oss's biases (by the entries' logical ids) and clamped SwiGLU, or
    DeepSeek-V4's clamp."""
    T, K, H, I, fmt, qb = _check(x, ids, gate_up, down, y)
    flat = ids.reshape(T * K).contiguous()  # [N]
    N = flat.numel()
    if N == 0:
        return y
    cfg = DECODE_CONFIG if config is None else config
    gd, gs, dd, ds = _operands(gate_up, down)
    lid, gub, db, alpha, limit, s_gub, s_db = act_args(act, x, N)
    a = torch.empty((N, I), dtype=torch.float32, device=x.device)  # [N, I]
    c = cfg["gate_up"]
    bn, bk = _block(c["BLOCK_N"], I), _block(c["BLOCK_K"], H)
    _q_gate_up_kernel[(N, triton.cdiv(I, bn))](
        x, flat, gd, gs, a, lid, gub, H, I, K, triton.cdiv(I, qb), alpha, limit,
        x.stride(0), gd.stride(0), gd.stride(1), gs.stride(0), gs.stride(1), a.stride(0), s_gub,
        FMT=fmt, QB=qb, BLOCK_N=bn, BLOCK_K=bk, ACT=act_code(act),
        num_warps=c.get("num_warps", 4))
    c = cfg["down"]
    bn, bk = _block(c["BLOCK_N"], H), _block(c["BLOCK_K"], I)
    _q_down_kernel[(N, triton.cdiv(H, bn))](
        a, flat, dd, ds, y, lid, db, H, I, K,
        a.stride(0), dd.stride(0), dd.stride(1), ds.stride(0), ds.stride(1),
        y.stride(0), y.stride(1), y.stride(2), s_db,
        ZERO_MISSING=zero_missing, FMT=fmt, QB=qb, BLOCK_N=bn, BLOCK_K=bk,
        ACT=act_code(act), num_warps=c.get("num_warps", 4))
    return y
