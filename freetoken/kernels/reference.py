"""The reference expert FFN every implementation is tested against (plain float64 torch, no
kernel, no batching trick): the grouped and gathered torch paths, the C++ CPU kernel, the Triton
fused MoE, and every expert backend. Quantized banks (freetoken/kernels/quant.py) enter it
dequantized in float64, so a kernel reading FP8 / MXFP4 is held to the exact dequantized weights.

It reads only the bank rows `topk_ids` names, one at a time, and the banks may stay on their
device (each row is copied to the host as stored, then widened): at a real shape (1100 banks
of 2048 x 1024) a test checks a sample of tokens, `expert_ffn_reference(x[s], ids[s], ...)`,
and pays for the rows those tokens route to only."""
from __future__ import annotations

import torch
from torch import Tensor

from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.quant import QuantBank


def _f64(w: Tensor | QuantBank) -> Tensor:
    """One bank row in float64 on the host (copied as stored first: a bf16 row moves half the
    bytes of a float32 one, a quarter of a float64 one; the widening is exact either way)."""
    if isinstance(w, QuantBank):
        return w.cpu().dequantize(torch.float64)
    return w.detach().cpu().double()


def expert_ffn_reference(x: Tensor, topk_ids: Tensor, gate_up: Tensor, down: Tensor,
                         mask: Tensor | None = None, act: ExpertAct | None = None) -> Tensor:
    """y [T, K, H] float64: y[t, k] = down[e] · (silu(gate[e] · x[t]) ⊙ (up[e] · x[t])) with
    e = topk_ids[t, k], for entries with e >= 0 (and mask[t, k] when a mask is given); 0
    elsewhere. x [T, H]; gate_up [E, 2I, H] rows [gate | up]; down [E, H, I]. With `act`
    (freetoken/kernels/expert_act.py, bound to the logical ids) gpt-oss's biased, clamped SwiGLU
    ("oai"), or DeepSeek-V4's silu(min(g, limit)) ⊙ clamp(u, ±limit) without biases ("clamp")."""
    T, K = topk_ids.shape
    topk_ids = topk_ids.cpu()  # (read entry by entry: one copy, not one sync per entry)
    mask = mask.cpu() if mask is not None else None
    inter = gate_up.shape[1] // 2
    out = torch.zeros(T, K, x.shape[-1], dtype=torch.float64)
    xd = x.detach().double().cpu()
    for t in range(T):
        for k in range(K):
            e = int(topk_ids[t, k])
            if e < 0 or (mask is not None and not bool(mask[t, k])):
                continue
            w = _f64(gate_up[e])  # [2I, H]
            g, u = w[:inter] @ xd[t], w[inter:] @ xd[t]  # [I]
            if act is None:
                out[t, k] = _f64(down[e]) @ (g * torch.sigmoid(g) * u)  # [H]
                continue
            if act.kind == "clamp":
                g, u = g.clamp(max=act.limit), u.clamp(-act.limit, act.limit)
                out[t, k] = _f64(down[e]) @ (g * torch.sigmoid(g) * u)  # [H]
                continue
            le = int(act.ids[t, k]) if act.ids is not None else e  # the bias's logical id
            gb = act.gate_up_bias[le].detach().double().cpu()  # [2I]
            g, u = (g + gb[:inter]).clamp(max=act.limit), (u + gb[inter:]).clamp(
                -act.limit, act.limit)
            a = (u + 1) * g * torch.sigmoid(act.alpha * g)  # [I]
            out[t, k] = _f64(down[e]) @ a + act.down_bias[le].detach().double().cpu()  # [H]
    return out

