"""Small fused kernels of the decode step (the others sit beside the ops they fuse: norm.py,
gdn.py, router.py), each replacing a chain of elementwise torch ops (one launch each, and under
a CUDA graph every launch still costs replay time).

- `moe_combine(y, w, residual, shared=None, shared_gate=None, gate_x=None, gate_weight=None)`:
  the MoE block's output merged with the residual stream,
  out[t] = residual[t] + Σ_k w[t,k]·y[t,k] (+ sigmoid(g[t])·shared[t]), summing k in a fixed
  order in fp32. The shared expert's gate g is given (`shared_gate` [T, 1], pre-sigmoid) or
  computed here as the Linear(H, 1) it is, g[t] = gate_x[t] · gate_weight[0] accumulated in fp32
  and rounded to gate_x's dtype as the Linear's output is (one launch instead of cuBLAS's dot,
  its reduce, and the sigmoid-mul chain). With `norm=` it also returns the next decoder
  layer's input RMSNorm of the result, so that norm costs no launch of its own.
- `moe_sum(y, w)`: the weighted merge alone.
- `sigmoid_gate_mul(o, gate)`: the gated attention's o * sigmoid(gate), gate a strided view.

Shapes: T tokens, K top-k, H hidden.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _combine_kernel(y_ptr, w_ptr, res_ptr, sh_ptr, sg_ptr, x_ptr, gw_ptr, out_ptr,
                    nw_ptr, norm_ptr, K, H, eps,
                    s_yt, s_yk, s_wt, s_rt, s_sh, s_sg, s_x, s_ot, s_nt,
                    HAS_SHARED: tl.constexpr, GATE_DOT: tl.constexpr, NORM: tl.constexpr,
                    ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    ar = tl.arange(0, BLOCK)
    offs = c * BLOCK + ar
    m = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(K):
        wk = tl.load(w_ptr + t * s_wt + k).to(tl.float32)
        acc += wk * tl.load(y_ptr + t * s_yt + k * s_yk + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_SHARED:
        if GATE_DOT:
            # every program of row t takes the whole (short) dot: no second launch
            d = tl.zeros([BLOCK], dtype=tl.float32)
            for h0 in range(0, H, BLOCK):
                mh = h0 + ar < H
                d += (tl.load(x_ptr + t * s_x + h0 + ar, mask=mh, other=0.0).to(tl.float32)
                      * tl.load(gw_ptr + h0 + ar, mask=mh, other=0.0).to(tl.float32))
            gate = tl.sum(d, 0).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            gate = tl.load(sg_ptr + t * s_sg).to(tl.float32)
        gate = 1.0 / (1.0 + tl.exp(-gate))
        acc += gate * tl.load(sh_ptr + t * s_sh + offs, mask=m, other=0.0).to(tl.float32)
    acc += tl.load(res_ptr + t * s_rt + offs, mask=m, other=0.0).to(tl.float32)
    s = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * s_ot + offs, s, mask=m)
    if NORM:
        # the next layer's input RMSNorm of the stored row (BLOCK >= H: one program per row),
        # the math of norm.py's _rmsnorm_kernel
        xf = tl.where(m, s.to(tl.float32), 0.0)
        xn = xf * (1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps))
        nw = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            yn = xn * (1.0 + nw)
        else:
            yn = xn.to(s.dtype).to(tl.float32) * nw
        tl.store(norm_ptr + t * s_nt + offs, yn.to(norm_ptr.dtype.element_ty), mask=m)


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def moe_combine(y: Tensor, w: Tensor, residual: Tensor, shared: Tensor | None = None,
                shared_gate: Tensor | None = None, gate_x: Tensor | None = None,
                gate_weight: Tensor | None = None,
                norm: tuple[Tensor, float, bool] | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """y [T, K, H] unweighted expert outputs, w [T, K] routing weights, residual [T, H];
    optional shared [T, H] with its pre-sigmoid gate: shared_gate [T, 1], or gate_x [T, H] and
    gate_weight [1, H] (the Linear's weight) to compute it here -> out [T, H] in residual's
    dtype. `norm` = (weight [H], eps, zero_centered): also return the RMSNorm of out (the next
    decoder layer's input norm, `freetoken.kernels.triton.norm.rmsnorm` semantics) from the same
    launch. Row strides are free; last dims must be contiguous (else copied)."""
    T, K, H = y.shape
    y, w, residual = _rows(y), _rows(w), _rows(residual)
    out = torch.empty((T, H), dtype=residual.dtype, device=residual.device)  # [T, H]
    has = shared is not None
    dot = has and shared_gate is None
    if has:
        shared = _rows(shared)
        if dot and (gate_x is None or gate_weight is None or gate_weight.numel() != H
                    or tuple(gate_x.shape) != (T, H)):
            raise ValueError("a shared expert needs shared_gate [T, 1] or gate_x [T, H] and "
                             "gate_weight [1, H]")
    sh = shared if has else residual
    sg = shared_gate if has and not dot else w
    gx = _rows(gate_x) if dot else residual
    gw = gate_weight.reshape(H) if dot else residual
    normed = nw = None
    eps, zc = 0.0, True
    if norm is not None:
        nw, eps, zc = norm
        if nw.shape != (H,):
            raise ValueError(f"norm weight {tuple(nw.shape)} does not match H={H}")
        ndt = out.dtype if zc else torch.promote_types(nw.dtype, out.dtype)
        normed = torch.empty((T, H), dtype=ndt, device=out.device)  # [T, H]
    if T:
        # with a norm, one program takes a whole row
        block = triton.next_power_of_2(H) if norm is not None else min(1024,
                                                                          triton.next_power_of_2(H))
        _combine_kernel[(T, triton.cdiv(H, block))](
            y, w, residual, sh, sg, gx, gw, out,
            nw if norm is not None else residual, normed if norm is not None else out,
            K, H, float(eps),
            y.stride(0), y.stride(1), w.stride(0), residual.stride(0), sh.stride(0),
            sg.stride(0), gx.stride(0), out.stride(0),
            normed.stride(0) if normed is not None else 0,
            HAS_SHARED=has, GATE_DOT=dot, NORM=norm is not None, ZERO_CENTERED=bool(zc),
            BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out if norm is None else (out, normed)


@triton.jit
def _moe_sum_kernel(
    y_ptr, w_ptr, out_ptr, H,
    stride_yt, stride_yk, stride_wt, stride_ot,
    TOPK: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        wk = tl.load(w_ptr + t * stride_wt + k).to(tl.float32)
        yk = tl.load(y_ptr + t * stride_yt + k * stride_yk + h, mask=h < H, other=0.0)
        acc += wk * yk.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


def moe_sum(y: Tensor, w: Tensor, out: Tensor | None = None, block_h: int = 1024) -> Tensor:
    """out [T, H] = sum_k w[t, k] * y[t, k] in fp32, k = 0..K-1 in order, cast to y.dtype.

    y [T, K, H] and w [T, K] need a contiguous last dim. One launch instead of torch's mul + sum;
    in bf16 it rounds once (torch rounds each product to bf16 first), so it is the same sum to
    rounding, not bit-identical to `(y * w[..., None]).sum(1)`.
    """
    T, K, H = y.shape
    if tuple(w.shape) != (T, K) or y.stride(2) != 1 or w.stride(1) != 1:
        raise ValueError(f"moe_sum: y {tuple(y.shape)} and w {tuple(w.shape)} do not fit")
    if out is None:
        out = torch.empty((T, H), dtype=y.dtype, device=y.device)  # [T, H]
    if T == 0:
        return out
    bh = max(1, min(block_h, triton.next_power_of_2(H)))
    _moe_sum_kernel[(T, triton.cdiv(H, bh))](
        y, w, out, H, y.stride(0), y.stride(1), w.stride(0), out.stride(0),
        TOPK=K, BLOCK_H=bh, num_warps=4,
    )
    return out


@triton.jit
def _sigmoid_gate_mul_kernel(o_ptr, g_ptr, out_ptr, NH, D, s_ot, s_oh, s_gt, s_gh,
                             BLOCK_D: tl.constexpr):
    r = tl.program_id(0)  # one (token, head) row
    t = (r // NH).to(tl.int64)
    h = r % NH
    d = tl.arange(0, BLOCK_D)
    m = d < D
    o = tl.load(o_ptr + t * s_ot + h * s_oh + d, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * s_gt + h * s_gh + d, mask=m, other=0.0).to(tl.float32)
    # torch rounds sigmoid(gate) to the gate's dtype before the product
    sg = tl.sigmoid(g).to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * D + d, (o * sg).to(out_ptr.dtype.element_ty), mask=m)


def sigmoid_gate_mul(o: Tensor, gate: Tensor) -> Tensor:
    """o [T, Hh, D] * sigmoid(gate [T, Hh, D]) -> [T, Hh*D] contiguous, in the promoted dtype:
    the gated attention's output gate in one launch, reading both as strided views (the gate is
    the second half of each head of the q projection)."""
    T, NH, D = o.shape
    if gate.shape != o.shape or o.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(f"o {tuple(o.shape)} and gate {tuple(gate.shape)} must match with a "
                         "contiguous last dim")
    out = torch.empty((T, NH * D), dtype=torch.promote_types(o.dtype, gate.dtype),
                      device=o.device)  # [T, Hh*D]
    if T:
        _sigmoid_gate_mul_kernel[(T * NH,)](
            o, gate, out, NH, D, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1),
            BLOCK_D=triton.next_power_of_2(D), num_warps=1 if D <= 256 else 4)
    return out
