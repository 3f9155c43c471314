"""Layer-level decode-step operations with one entry point each: our Triton kernels on CUDA when
they are importable (the switch: freetoken/kernels/dispatch.py), plain torch otherwise. The expert
FFN's own paths are in freetoken/experts/ffn.py. The torch versions are the reference the kernels
are tested against and are themselves free of host syncs (index_select / index_copy_ by device slot
tensors), so a decode step stays capturable either way; the kernels remove the state gathers
and scatters and the launch count.

Shapes: B rows, C conv channels, Kc conv kernel, Hk key heads, Hv value heads, dk/dv head dims,
S pool slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken.kernels import dispatch
from freetoken.layers.gated_delta import recurrent_gated_delta


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def conv_update(x: Tensor, conv_pool: Tensor, weight: Tensor, slots: Tensor) -> Tensor:
    """One causal depthwise-conv step per row, state in place: window = [conv_pool[slot] | x],
    out = silu(Σ window·w), conv_pool[slot] = window[..., 1:].
    x [B, C]; conv_pool [S, C, Kc-1]; weight [C, Kc]; slots [B] -> out [B, C] in x's dtype."""
    mod = dispatch.triton_for(x, "gdn")
    if mod is not None:
        return mod.causal_conv1d_update_pool(x, conv_pool, weight, slots)
    window = torch.cat([conv_pool.index_select(0, slots),
                        x[:, :, None].to(conv_pool.dtype)], -1)  # [B, C, Kc]
    conv_pool.index_copy_(0, slots, window[..., 1:])
    return F.silu((window.to(weight.dtype) * weight).sum(-1)).to(x.dtype)  # [B, C]


def gdn_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_pool: Tensor,
                  slots: Tensor, gates: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One gated-delta-rule step per row with the state read and written in place.
    q, k [B, Hk, dk] raw (L2-normalised here); v [B, Hv, dv]; g, beta [B, Hv];
    ssm_pool [S, Hv, dk, dv] fp32; slots [B] -> o [B, Hv, dv] fp32. `gates` = (A_log,
    dt_bias) [Hv]: g, beta are the raw projections a, b and `gdn_gates` is applied here (in the
    same launch on CUDA)."""
    mod = dispatch.triton_for(q, "gdn")
    if mod is not None:
        return mod.gdn_recurrent_pool(q, k, v, g, beta, ssm_pool, slots, raw_gates=gates)
    if gates is not None:
        g, beta = gdn_gates(g, beta, *gates)
    r = v.shape[1] // q.shape[1]
    qf = l2norm(q.float()).repeat_interleave(r, dim=1)  # [B, Hv, dk]
    kf = l2norm(k.float()).repeat_interleave(r, dim=1)  # [B, Hv, dk]
    o, s = recurrent_gated_delta(qf, kf, v, g, beta, ssm_pool.index_select(0, slots))
    ssm_pool.index_copy_(0, slots, s)
    return o


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ssm_pool: Tensor,
                  slots: Tensor) -> Tensor:
    """One Kimi-Delta-Attention step per row with the state read and written in place.
    q, k [B, H, K] L2-normalised; v [B, H, V]; g [B, H, K] log decay; beta [B, H];
    ssm_pool [S, H, K, V] fp32; slots [B] -> o [B, H, V] fp32."""
    mod = dispatch.triton_for(q, "kda")
    if mod is not None:
        return mod.kda_recurrent_pool(q, k, v, g, beta, ssm_pool, slots)
    from freetoken.layers.kda_rule import recurrent_kda

    o, s = recurrent_kda(q, k, v, g, beta, ssm_pool.index_select(0, slots))
    ssm_pool.index_copy_(0, slots, s)
    return o


def router(x: Tensor, weight: Tensor, top_k: int, renormalize: bool,
           row_mask: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """Fused softmax → top-k → renormalise (ids -1 outside `row_mask`) on CUDA, or None (the
    caller's torch path)."""
    mod = dispatch.triton_for(x, "router")
    if mod is None:
        return None
    return mod.fused_router(x, weight, top_k, renormalize, row_mask)


def gdn_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """g = -exp(A_log)·softplus(a + dt_bias) fp32, beta = sigmoid(b) in b's dtype: a, b
    [T, Hv] -> [T, Hv] each."""
    mod = dispatch.triton_for(a, "gdn")
    if mod is not None:
        return mod.gdn_gates(a, b, a_log, dt_bias)
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


def sigmoid_gate_mul(o: Tensor, gate: Tensor) -> Tensor:
    """o * sigmoid(gate) flattened to [T, Hh*D]: o, gate [T, Hh, D] (gate a strided view)."""
    mod = dispatch.triton_for(o, "decode_fusions")
    if mod is not None:
        return mod.sigmoid_gate_mul(o, gate)
    T = o.shape[0]
    return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))


def moe_combine(y: Tensor, w: Tensor, residual: Tensor, shared: Tensor | None = None,
                gate_x: Tensor | None = None, gate_weight: Tensor | None = None,
                next_norm=None) -> Tensor | tuple[Tensor, Tensor]:
    """out = residual + Σ_k w·y (+ sigmoid(gate_x @ gate_weightᵀ)·shared): y [T, K, H],
    w [T, K], residual, shared, gate_x [T, H], gate_weight [1, H] (the shared expert gate's
    Linear). With `next_norm` (an RMSNorm) returns (out, next_norm(out)), one launch on CUDA."""
    mod = dispatch.triton_for(y, "decode_fusions")
    if mod is not None:
        norm = (None if next_norm is None
                else (next_norm.weight, next_norm.eps, next_norm.zero_centered))
        return mod.moe_combine(y, w, residual, shared, gate_x=gate_x, gate_weight=gate_weight,
                               norm=norm)
    out = (y * w[..., None]).sum(1)  # [T, H]
    if shared is not None:
        out = out + torch.sigmoid(F.linear(gate_x, gate_weight)) * shared
    out = residual + out
    return out if next_norm is None else (out, next_norm(out))
