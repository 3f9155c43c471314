"""What the decode (fused_moe.py) and grouped (moe_grouped.py) MoE kernels share: argument
checks, block sizing, whether the interpreter runs them, and the experts' activation epilogue
(`_glu`, `act_args`: freetoken/kernels/expert_act.py). One home, so neither imports the
other's module for it."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_args(x: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, y: Tensor
               ) -> tuple[int, int, int, int]:
    """Validate shapes, dtypes and layouts; returns (T, K, H, I)."""
    if x.dim() != 2 or ids.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3 or y.dim() != 3:
        raise ValueError("expected x [T,H], ids [T,K], gate_up [S,2I,H], down [S,H,I], y [T,K,H]")
    T, H = x.shape
    K = ids.shape[1]
    S, two_i, h2 = gate_up.shape
    I = two_i // 2
    if (ids.shape[0] != T or h2 != H or two_i != 2 * I or tuple(down.shape) != (S, H, I)
            or tuple(y.shape) != (T, K, H)):
        raise ValueError(
            f"shape mismatch: x={tuple(x.shape)} ids={tuple(ids.shape)} "
            f"gate_up={tuple(gate_up.shape)} down={tuple(down.shape)} y={tuple(y.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}")
    # the banks are never copied, so their rows must already be contiguous along the reduction
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("x, gate_up and down need a contiguous last dimension")
    devs = {x.device, ids.device, gate_up.device, down.device, y.device}
    if len(devs) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devs))}")
    return T, K, H, I


def _block(want: int, dim: int, least: int = 1) -> int:
    """The configured block, shrunk to the problem (tiny test shapes) but never below `least`."""
    return max(least, min(want, triton.next_power_of_2(dim)))


# -- the experts' activation (freetoken/kernels/expert_act.py `act_code`): ACT 0 the plain
# SwiGLU, 1 gpt-oss's (biases by logical id, clamped), 2 DeepSeek-V4's clamp (no biases)
# ----------

@triton.jit
def _glu(gate, up, alpha, limit, ACT: tl.constexpr):
    """The activation of fp32 gate/up rows (any shape, biases already added): ACT 0
    silu(g) * u; 1 gpt-oss's (clamp(u, ±limit) + 1) * g * σ(alpha * g) with g = min(g, limit);
    2 DeepSeek-V4's silu(min(g, limit)) * clamp(u, ±limit)."""
    if ACT == 1:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        a = (u + 1.0) * g * tl.sigmoid(alpha * g)
    elif ACT == 2:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        a = g * tl.sigmoid(g) * u
    else:
        a = gate * tl.sigmoid(gate) * up
    return a


@triton.jit
def _bias_gu_2d(acc_g, acc_u, lid_ptr, gub_ptr, ent, ent_ok, i, i_ok, I, stride_gub):
    """(gate, up) [BM, BN] + the gate_up bias rows of each entry's logical expert lid[ent]."""
    le = tl.load(lid_ptr + ent, mask=ent_ok, other=0).to(tl.int64)  # [BM]
    gb = gub_ptr + le[:, None] * stride_gub + i[None, :]  # [BM, BN]
    m = ent_ok[:, None] & i_ok[None, :]
    return (acc_g + tl.load(gb, mask=m, other=0.0).to(tl.float32),
            acc_u + tl.load(gb + I, mask=m, other=0.0).to(tl.float32))


@triton.jit
def _bias_down_2d(acc, lid_ptr, db_ptr, ent, ent_ok, h, h_ok, stride_db):
    """acc [BM, BN] + the down bias rows (columns h) of each entry's logical expert."""
    le = tl.load(lid_ptr + ent, mask=ent_ok, other=0).to(tl.int64)  # [BM]
    db = db_ptr + le[:, None] * stride_db + h[None, :]  # [BM, BN]
    return acc + tl.load(db, mask=ent_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)


def act_args(act, x: Tensor, N: int) -> tuple:
    """The kernels' act operands: (logical ids [N], gate_up bias [E, 2I], down bias [E, H],
    alpha, limit, bias row strides) from a bound ExpertAct on x's device; dummies (x) in place
    of what the kernels never read: everything when `act` is None (ACT 0), the ids and biases
    under "clamp" (ACT 2). Checks the ids of a biased act cover the N entries."""
    if act is None:
        return x, x, x, 0.0, 0.0, 0, 0
    if not act.has_bias:
        return x, x, x, float(act.alpha), float(act.limit), 0, 0
    lid = act.entry_ids()
    if lid.numel() != N:
        raise ValueError(f"act bound to {lid.numel()} entries, the step has {N}")
    if lid.device != x.device or act.gate_up_bias.device != x.device:
        raise ValueError("the act's ids and biases must be on x's device (ExpertAct.to)")
    gub, db = act.gate_up_bias, act.down_bias
    if gub.stride(-1) != 1 or db.stride(-1) != 1 or not lid.is_contiguous():
        lid, gub, db = lid.contiguous(), gub.contiguous(), db.contiguous()
    return lid, gub, db, float(act.alpha), float(act.limit), gub.stride(0), db.stride(0)
