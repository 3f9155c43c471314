"""A small fused kernel of the decode step (the others sit beside the ops they fuse: norm.py,
gdn.py, router.py), replacing a chain of elementwise torch ops (one
launch each; under a CUDA graph every launch still costs replay time, not yet measured per
launch).

- `moe_combine(y, w, residual, shared=None, shared_gate=None)`: the MoE block's output merged
  with the residual stream, out[t] = residual[t] + Σ_k w[t,k]·y[t,k] (+ sigmoid(gate[t])·shared[t]),
  summing k in a fixed order in fp32.

Shapes: T tokens, K top-k, H hidden.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _combine_kernel(y_ptr, w_ptr, res_ptr, sh_ptr, sg_ptr, out_ptr, K, H, s_sg,
                    HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(K):
        wk = tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += wk * tl.load(y_ptr + (t * K + k) * H + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_SHARED:
        gate = tl.load(sg_ptr + t * s_sg).to(tl.float32)
        gate = 1.0 / (1.0 + tl.exp(-gate))
        acc += gate * tl.load(sh_ptr + t * H + offs, mask=m, other=0.0).to(tl.float32)
    acc += tl.load(res_ptr + t * H + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def moe_combine(y: Tensor, w: Tensor, residual: Tensor, shared: Tensor | None = None,
                shared_gate: Tensor | None = None) -> Tensor:
    """y [T, K, H] unweighted expert outputs, w [T, K] routing weights, residual [T, H],
    shared [T, H] and shared_gate [T, 1] (pre-sigmoid) optional -> [T, H] in residual's dtype."""
    T, K, H = y.shape
    y, w, residual = y.contiguous(), w.contiguous(), residual.contiguous()
    out = torch.empty_like(residual)
    has = shared is not None
    sh = shared.contiguous() if has else residual
    sg = shared_gate if has else w
    block = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block))](y, w, residual, sh, sg, out, K, H,
                                                sg.stride(0), HAS_SHARED=has, BLOCK=block)
    return out
