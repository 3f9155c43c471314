"""RMSNorm (plain or zero-centred, optionally fused with the residual add) and the gated
RMSNorm of Gated DeltaNet, one launch each, with the dtype semantics of
`freetoken.layers.norm` exactly:

  zero-centred: y = (norm(x)·(1 + w)) in fp32, cast to x's dtype            (qwen3_next / 3.5)
  plain:        y = w · norm(x).to(x.dtype), in the promoted dtype of (w, x)  (qwen3_moe)
  gated:        y = (w · norm(x).to(x.dtype)) · silu(z) in fp32, cast to x's dtype

norm(x) = x·rsqrt(mean(x²) + eps) over the last dim, computed in fp32. With `residual`, the
norm input is s = x + residual rounded to their promoted dtype (what `x = x + h` stores in a
pre-norm decoder), and s is returned as the new residual stream.

Shapes: any leading shape, N = the normalised (last) dim; R rows = numel / N. Each program
takes BLOCK_R rows; the grid depends on shapes only (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["R"])  # sizes/indices: 1 compile
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, R, N, eps,
    s_x, s_r, s_y, s_s,
    HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    n = tl.arange(0, BLOCK_N)  # [BN]
    ok = (r < R)[:, None] & (n < N)[None, :]  # [BR, BN]
    r = r.to(tl.int64)
    x = tl.load(x_ptr + r[:, None] * s_x + n[None, :], mask=ok, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + r[:, None] * s_r + n[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + r[:, None] * s_s + n[None, :], x, mask=ok)
    xf = x.to(tl.float32)
    xn = xf * (1.0 / tl.sqrt(tl.sum(xf * xf, 1) / N + eps))[:, None]  # [BR, BN]
    w = tl.load(w_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]  # [1, BN]
    if ZERO_CENTERED:
        y = xn * (1.0 + w)
    else:
        y = xn.to(x.dtype).to(tl.float32) * w
    tl.store(y_ptr + r[:, None] * s_y + n[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["R"])  # sizes/indices: 1 compile
def _gated_rmsnorm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, R, N, HH, eps,
    s_xt, s_xh, s_zt, s_zh, s_y,
    MID: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] rows = (token, head)
    n = tl.arange(0, BLOCK_N)  # [BN]
    ok = (r < R)[:, None] & (n < N)[None, :]
    r = r.to(tl.int64)
    t, hh = r // HH, r % HH
    # x rounds to the output dtype first (the caller's `.to(dtype)` of an fp32 core output)
    x = tl.load(x_ptr + (t * s_xt + hh * s_xh)[:, None] + n[None, :], mask=ok, other=0.0)
    x = x.to(y_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    xn = xf * (1.0 / tl.sqrt(tl.sum(xf * xf, 1) / N + eps))[:, None]
    w = tl.load(w_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    y = (xn.to(x.dtype).to(tl.float32) * w).to(MID).to(tl.float32)  # w · norm(x) in torch's dtype
    z = tl.load(z_ptr + (t * s_zt + hh * s_zh)[:, None] + n[None, :], mask=ok,
                other=0.0).to(tl.float32)
    tl.store(y_ptr + r[:, None] * s_y + n[None, :],
             (y * (z * tl.sigmoid(z))).to(y_ptr.dtype.element_ty), mask=ok)


def _rows(t: Tensor, n: int) -> Tensor:
    """[..., N] -> [R, N] with unit stride along N (a view where torch allows one)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _head_rows(t: Tensor, n: int, hh: int) -> tuple[Tensor, int, int]:
    """(tensor, token stride, head stride) addressing row r = token * hh + head: a 3-D
    [T, hh, N] tensor in place, anything else as `_rows` gives it."""
    if t.dim() == 3 and t.shape[1] == hh and t.stride(-1) == 1:
        return t, t.stride(0), t.stride(1)
    t2 = _rows(t, n)  # [R, N]
    return t2, hh * t2.stride(0), t2.stride(0)


def _blocks(n: int) -> tuple[int, int, int]:
    bn = triton.next_power_of_2(n)
    br = max(1, min(16, 4096 // bn))
    return br, bn, 4 if br * bn <= 4096 else 8


def rmsnorm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool,
            residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x [..., N], weight [N]. Returns y [..., N], or (y, x + residual) when `residual` is
    given (normalised after the add)."""
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim {N}")
    x2 = _rows(x, N)  # [R, N]
    R = x2.shape[0]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        r2 = _rows(residual, N)  # [R, N]
        sdt = torch.promote_types(x.dtype, residual.dtype)
        s2 = torch.empty(R, N, dtype=sdt, device=x.device)  # [R, N] the new residual
    else:
        r2 = s2 = x2  # unused
        sdt = x.dtype
    ydt = sdt if zero_centered else torch.promote_types(weight.dtype, sdt)
    y2 = torch.empty(R, N, dtype=ydt, device=x.device)  # [R, N]
    if R:
        _launch_rmsnorm(x2, r2, weight, y2, s2, eps, residual is not None, zero_centered)
    y = y2.view(x.shape)
    return y if residual is None else (y, s2.view(x.shape))


def _launch_rmsnorm(x2, r2, weight, y2, s2, eps, has_res, zero_centered) -> None:
    R, N = x2.shape
    br, bn, warps = _blocks(N)
    _rmsnorm_kernel[(triton.cdiv(R, br),)](
        x2, r2, weight, y2, s2, R, N, eps,
        x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0),
        HAS_RES=has_res, ZERO_CENTERED=zero_centered,
        BLOCK_R=br, BLOCK_N=bn, num_warps=warps,
    )


def gated_rmsnorm(x: Tensor, z: Tensor, weight: Tensor, eps: float,
                  x_dtype: torch.dtype | None = None) -> Tensor:
    """GatedRMSNorm: (w · norm(x)) · silu(z). x, z [..., N]; weight [N]; y in x's dtype, or
    in `x_dtype` with x rounded to it first (= `gated_rmsnorm(x.to(x_dtype), ...)`, one launch
    less for the gated DeltaNet's fp32 output). A 3-D x or z [T, Hh, N] is read with its own
    token and head strides (z is a view into the fused input projection: no copy at T > 1)."""
    N = x.shape[-1]
    if z.shape != x.shape or weight.shape != (N,):
        raise ValueError(f"shapes x {tuple(x.shape)}, z {tuple(z.shape)}, "
                         f"weight {tuple(weight.shape)} do not match")
    hh = x.shape[1] if x.dim() == 3 else 1
    x2, s_xt, s_xh = _head_rows(x, N, hh)
    z2, s_zt, s_zh = _head_rows(z, N, hh)
    R = x.numel() // N if N else 0
    xdt = x.dtype if x_dtype is None else x_dtype
    y2 = torch.empty(R, N, dtype=xdt, device=x.device)  # [R, N]
    if not R:
        return y2.view(x.shape)
    br, bn, warps = _blocks(N)
    _gated_rmsnorm_kernel[(triton.cdiv(R, br),)](
        x2, z2, weight, y2, R, N, hh, eps, s_xt, s_xh, s_zt, s_zh, y2.stride(0),
        MID=_TL[torch.promote_types(weight.dtype, xdt)], BLOCK_R=br, BLOCK_N=bn,
        num_warps=warps,
    )
    return y2.view(x.shape)


@triton.jit
def _norm_value(xn, w, X_DT: tl.constexpr, NORM_DT: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    # the RMSNorm module's rounding points, then back to fp32 for the rotation
    if ZERO_CENTERED:
        y = (xn * (1.0 + w)).to(NORM_DT)
    else:
        y = (xn.to(X_DT).to(tl.float32) * w).to(NORM_DT)
    return y.to(tl.float32)


@triton.jit(do_not_specialize=["R"])  # sizes/indices: 1 compile
def _rmsnorm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, rows_ptr, v_ptr, vo_ptr, R, H, N, eps,
    s_xt, s_xh, s_c, s_s, s_yt, s_yh, s_vt, s_vh, s_vot, s_voh,
    ROT: tl.constexpr, ZERO_CENTERED: tl.constexpr, NORM_DT: tl.constexpr,
    HAS_ROWS: tl.constexpr, COPY_V: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] rows of [T*H]
    n = tl.arange(0, BLOCK_N)  # [BN]
    r_ok = r < R
    ok = r_ok[:, None] & (n < N)[None, :]
    t = (r // H).to(tl.int64)
    xrow = x_ptr + t * s_xt + (r % H) * s_xh  # [BR]
    x = tl.load(xrow[:, None] + n[None, :], mask=ok, other=0.0)
    X_DT: tl.constexpr = x_ptr.dtype.element_ty
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / N + eps)  # [BR]
    w = tl.load(w_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    y = _norm_value(xf * rstd[:, None], w, X_DT, NORM_DT, ZERO_CENTERED)  # [BR, BN]
    # rotate-half over the first ROT dims: dim d pairs with d ± ROT/2
    rot_d = (n < ROT)[None, :]
    p = tl.where(n < ROT // 2, n + ROT // 2, n - ROT // 2)  # [BN]
    xp = tl.load(xrow[:, None] + p[None, :], mask=r_ok[:, None] & rot_d, other=0.0)
    wp = tl.load(w_ptr + p, mask=n < ROT, other=0.0).to(tl.float32)[None, :]
    yp = _norm_value(xp.to(tl.float32) * rstd[:, None], wp, X_DT, NORM_DT, ZERO_CENTERED)
    yp = tl.where((n < ROT // 2)[None, :], -yp, yp)
    c = tl.load(cos_ptr + t[:, None] * s_c + n[None, :], mask=r_ok[:, None] & rot_d,
                other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t[:, None] * s_s + n[None, :], mask=r_ok[:, None] & rot_d,
                other=0.0).to(tl.float32)
    OUT_DT: tl.constexpr = y_ptr.dtype.element_ty
    a = (y * c).to(OUT_DT).to(tl.float32)
    b = (yp * s).to(OUT_DT).to(tl.float32)
    out = tl.where(rot_d, a + b, y)
    if HAS_ROWS:  # row t goes to output row rows[t] (a KV-pool slot)
        orow = tl.load(rows_ptr + t, mask=r_ok, other=0).to(tl.int64)  # [BR]
    else:
        orow = t
    tl.store(y_ptr + (orow * s_yt + (r % H) * s_yh)[:, None] + n[None, :], out.to(OUT_DT),
             mask=ok)
    if COPY_V:  # the same rows of v, unchanged, into their slots of the V pool
        vv = tl.load(v_ptr + (t * s_vt + (r % H) * s_vh)[:, None] + n[None, :], mask=ok,
                     other=0.0)
        tl.store(vo_ptr + (orow * s_vot + (r % H) * s_voh)[:, None] + n[None, :],
                 vv.to(vo_ptr.dtype.element_ty), mask=ok)


def rmsnorm_rope(x: Tensor, weight: Tensor, eps: float, zero_centered: bool, cos: Tensor,
                 sin: Tensor) -> Tensor:
    """The attention's q/k prologue in one launch: apply_rotary(RMSNorm(x), cos, sin) with the
    modules' roundings. x [T, H, D] (row strides free: the q half of the gated projection is a
    view); weight [D]; cos, sin [T, R] with R <= D even (partial rotary: the first R dims rotate,
    rotate-half convention). Returns [T, H, D], contiguous."""
    T, H, N = _check_rope(x, weight, cos, sin)
    y = torch.empty(T, H, N, dtype=rope_dtype(x, weight, zero_centered, cos),
                    device=x.device)  # [T, H, D]
    _launch_rope(x, weight, eps, zero_centered, cos, sin, y, None, None, None)
    return y


def rmsnorm_rope_store(k: Tensor, weight: Tensor, eps: float, zero_centered: bool, cos: Tensor,
                       sin: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, slots: Tensor
                       ) -> None:
    """The decode step's K/V write in one launch: k_pool[slots[t]] = rmsnorm_rope(k)[t] and
    v_pool[slots[t]] = v[t] (= `index_copy_` of both). k, v [T, Hk, D] (row strides free);
    pools [S, Hk, D] in the dtype rmsnorm_rope would return (checked: no second rounding);
    slots [T] distinct."""
    T, H, N = _check_rope(k, weight, cos, sin)
    dt = rope_dtype(k, weight, zero_centered, cos)
    if (k_pool.dtype != dt or v_pool.dtype != dt or k_pool.shape[1:] != (H, N)
            or v_pool.shape[1:] != (H, N) or v.shape != k.shape or slots.shape != (T,)):
        raise ValueError(f"pools {k_pool.dtype} {tuple(k_pool.shape)} / {tuple(v_pool.shape)}, "
                         f"v {tuple(v.shape)}, slots {tuple(slots.shape)} do not fit k "
                         f"{tuple(k.shape)} -> {dt}")
    if v.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("v and the pools need a contiguous head dim")
    _launch_rope(k, weight, eps, zero_centered, cos, sin, k_pool, slots, v, v_pool)


def _check_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor) -> tuple[int, int, int]:
    T, H, N = x.shape
    rot = cos.shape[-1]
    if weight.shape != (N,) or cos.shape != (T, rot) or sin.shape != cos.shape:
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)} do not match")
    if rot % 2 or rot > N or x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary dims must be even, <= D, and the last dims contiguous")
    return T, H, N


def rope_dtype(x: Tensor, weight: Tensor, zero_centered: bool, cos: Tensor) -> torch.dtype:
    ndt = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
    return torch.promote_types(ndt, cos.dtype)


def _launch_rope(x, weight, eps, zero_centered, cos, sin, y, rows, v, v_out) -> None:
    T, H, N = x.shape
    R = T * H
    if not R:
        return
    ndt = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
    vv, vo = (v, v_out) if v is not None else (x, y)
    br, bn, warps = _blocks(N)
    _rmsnorm_rope_kernel[(triton.cdiv(R, br),)](
        x, weight, cos, sin, y, rows if rows is not None else cos, vv, vo, R, H, N, eps,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), y.stride(0), y.stride(1),
        vv.stride(0), vv.stride(1), vo.stride(0), vo.stride(1),
        ROT=cos.shape[-1], ZERO_CENTERED=zero_centered, NORM_DT=_TL[ndt],
        HAS_ROWS=rows is not None, COPY_V=v is not None, BLOCK_R=br, BLOCK_N=bn,
        num_warps=warps,
    )
