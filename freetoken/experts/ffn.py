"""The expert FFN's compute paths over a bank (a layer's resident banks, or a slot cache's
slots through slot ids): the grouped torch path, the gathered path for decode-sized batches on
CUDA, the C++ kernel for a CPU decode row, and the Triton fused MoE. Every path returns per
(token, k) UNWEIGHTED outputs and equals `freetoken.kernels.reference.expert_ffn_reference`.

Shapes: T tokens, H hidden, E experts, K top-k, I expert intermediate, U unique experts hit,
N = T*K entries. A bank may be a `freetoken.kernels.quant.QuantBank` (FP8, MXFP4): the C++ CPU
kernel reads it as it is; the torch paths dequantize the rows they use (`as_weight`); on CUDA the
Triton decode and grouped paths dequantize in the kernel (freetoken/kernels/triton/moe_quant.py,
moe_quant_grouped.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken.kernels import dispatch
from freetoken.kernels.expert_act import ExpertAct, expert_bias_row, glu
from freetoken.kernels.quant import QuantBank, as_weight


def expert_group_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                         biases: tuple[Tensor | None, Tensor | None] = (None, None),
                         act: ExpertAct | None = None) -> torch.Tensor:
    """One expert on the tokens routed to it. x [n, H]; gate_up [2I, H]; down [H, I] -> [n, H].
    `biases` (gate_up [2I], down [H]) and `act` for gpt-oss's or DeepSeek-V4's experts
    (freetoken/kernels/expert_act.py)."""
    gu = F.linear(x, as_weight(gate_up, x.dtype), biases[0])  # [n, 2I]
    return F.linear(glu(gu, act), as_weight(down, x.dtype), biases[1])  # [n, H]


# On CUDA, batches of at most this many (token, k) entries take the gathered path: a fixed
# handful of kernels and no host sync, instead of ~10 launches per distinct expert.
GATHER_MAX_ENTRIES = 64


def gathered_experts(x: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None,
                     act: ExpertAct | None = None) -> torch.Tensor:
    """Decode-sized batches: gather each entry's expert weights and run two batched GEMVs.
    Entries outside `mask` (or with id < 0) keep y's value. N = T*K entries."""
    T, K = topk_ids.shape
    keep = topk_ids >= 0 if mask is None else mask & (topk_ids >= 0)  # [T, K]
    flat = topk_ids.clamp(min=0).reshape(-1)  # [N]
    xs = x.repeat_interleave(K, dim=0)[:, :, None]  # [N, H, 1]
    gu = torch.bmm(as_weight(gate_up[flat], x.dtype), xs)[..., 0]  # [N, 2I]
    le = None  # [N] the biases' logical ids ("oai"; "clamp" has no biases)
    if act is not None and act.has_bias:
        le = act.entry_ids().clamp(min=0)
    if le is not None:
        gu = gu + act.gate_up_bias[le].to(x.dtype)  # [N, 2I]
    a = glu(gu, act)[:, :, None]  # [N, I, 1]
    o = torch.bmm(as_weight(down[flat], x.dtype), a)[..., 0]  # [N, H]
    if le is not None:
        o = o + act.down_bias[le].to(x.dtype)
    o = o.view(T, K, -1)  # [T, K, H]
    y.copy_(torch.where(keep[..., None], o.to(y.dtype), y))
    return y


def dispatch_experts(x: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None,
                    bank_index: torch.Tensor | None = None, num_threads: int | None = None,
                    act: ExpertAct | None = None) -> torch.Tensor:
    """Fill y [T, K, H] for the (t, k) entries selected by `mask` [T, K] (all if None), reading
    each expert's weights once for all its tokens. `bank_index` maps a logical expert id to its
    row in gate_up/down (slot ids for a slot cache); identity if None. `num_threads`: the C++
    kernel's threads for a decode row on the CPU (None: torch's thread count). `act`: gpt-oss's
    biased, clamped SwiGLU, bound to the entries' logical ids, or DeepSeek-V4's clamped one
    (freetoken/kernels/expert_act.py)."""
    if (x.is_cuda and bank_index is None and topk_ids.numel() <= GATHER_MAX_ENTRIES):
        return gathered_experts(x, topk_ids, gate_up, down, y, mask, act)
    if x.device.type == "cpu" and x.shape[0] == 1 and bank_index is None:
        # One decode row on the CPU: one call of the C++ expert kernel instead of ~25 torch ops
        # per layer. Every backend computes its CPU-side decode rows here (fused, slot hits on
        # a CPU cache, the CPU branch), each expert of a row by the same dot products, so the
        # backends stay bit-identical to each other in fp32.
        from freetoken.kernels.cpu.expert_ops import cpu_experts

        keep = topk_ids >= 0 if mask is None else mask & (topk_ids >= 0)  # [1, K]
        o = cpu_experts(x, topk_ids.clamp(min=0), gate_up, down, compute_mask=keep,
                        num_threads=num_threads, act=act)  # [1, K, H]
        y[keep] = o[keep].to(y.dtype)
        return y
    flat = topk_ids.reshape(-1)  # [T*K]
    valid = flat >= 0 if mask is None else mask.reshape(-1) & (flat >= 0)  # ids < 0: no expert
    sel = torch.arange(flat.numel(), device=flat.device)[valid]
    if sel.numel() == 0:
        return y
    order = sel[torch.argsort(flat[sel], stable=True)]  # entries grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)  # [U], [U]
    K = topk_ids.shape[1]
    y2 = y.view(-1, y.shape[-1])  # [T*K, H]
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        ent = order[start:start + c]  # [c] flat (t, k) entries routed to e
        start += c
        row = e if bank_index is None else int(bank_index[e])
        biases = expert_bias_row(act, int(ent[0]), x.dtype)
        y2[ent] = expert_group_forward(x[ent // K], gate_up[row], down[row], biases,
                                       act).to(y.dtype)
    return y


def run_experts(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                act: ExpertAct | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The routed experts of a bank (`fused`'s experts, or a slot cache's slots through slot
    ids): y [T, K, H] unweighted, zeros where ids < 0 (entries routed elsewhere, padding).
    `shared` = (gate_up [2I, H], down [H, I]) of the block's shared expert: the Triton decode
    path runs it in the routed experts' two launches when its I matches and returns its output
    [T, H]; otherwise the second value is None and the caller runs it. `act` (gpt-oss's
    experts bound to the logical ids, or DeepSeek-V4's "clamp"): every Triton path takes it
    (dense and quantized banks); without Triton (the CPU) the torch paths and the C++ kernel.
    With an act the shared expert never rides the launches (the block runs it: its activation
    is the block's to choose)."""
    T, K = ids.shape
    H = x.shape[-1]
    if act is not None:
        act = act.to(x.device)
    if isinstance(gate_up, QuantBank):
        qmod = dispatch.triton_for(x, "moe_quant")
        if qmod is not None and ids.numel() <= qmod.DECODE_MAX_ENTRIES:
            y = torch.empty(T, K, H, dtype=x.dtype, device=x.device)  # [T, K, H]
            return qmod.fused_moe_quant_decode(x, ids, gate_up, down, y, zero_missing=True,
                                               act=act), None
        gmod = dispatch.triton_for(x, "moe_quant_grouped")
        if gmod is not None:
            y = torch.zeros(T, K, H, dtype=x.dtype, device=x.device)  # ids < 0 stay zero
            return gmod.fused_moe_quant_grouped(x, ids, gate_up, down, y, act=act), None
    if act is not None:
        mod = None if isinstance(gate_up, QuantBank) else dispatch.triton_for(x, "fused_moe")
        if mod is not None:
            y = torch.empty(T, K, H, dtype=x.dtype, device=x.device)  # [T, K, H]
            return mod.fused_moe(x, ids, gate_up, down, y, zero_missing=True, act=act), None
        y = torch.zeros(T, K, H, dtype=x.dtype, device=x.device)  # [T, K, H]
        return dispatch_experts(x, ids, gate_up, down, y, act=act), None
    mod = None if isinstance(gate_up, QuantBank) else dispatch.triton_for(x, "fused_moe")
    if mod is None:
        y = torch.zeros(T, K, H, dtype=x.dtype, device=x.device)  # [T, K, H]
        if fused_moe(x, ids, gate_up, down, y) is None:
            dispatch_experts(x, ids, gate_up, down, y)
        return y, None
    y = torch.empty(T, K, H, dtype=x.dtype, device=x.device)  # [T, K, H], every entry set
    if (shared is not None and ids.numel() <= mod.DECODE_MAX_ENTRIES
            and shared[0].shape[0] == gate_up.shape[1]):
        ys = torch.empty(T, H, dtype=x.dtype, device=x.device)  # [T, H]
        mod.fused_moe_decode(x, ids, gate_up, down, y, zero_missing=True, shared=(*shared, ys))
        return y, ys
    return mod.fused_moe(x, ids, gate_up, down, y, zero_missing=True), None


def fused_moe(x: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, y: Tensor,
              act: ExpertAct | None = None) -> Tensor | None:
    """The Triton fused MoE (unweighted [T, K, H] into y, ids < 0 left untouched) on CUDA, or
    None when it is unavailable or the bank is quantized (the caller keeps its torch path).
    `act` (freetoken/kernels/expert_act.py) selects the kernels' ACT epilogue."""
    mod = None if isinstance(gate_up, QuantBank) else dispatch.triton_for(x, "fused_moe")
    if mod is None:
        return None
    return mod.fused_moe(x, ids, gate_up, down, y,
                         act=None if act is None else act.to(x.device))


# a shared expert runs in the decode GEMV kernels up to this many tokens (each token re-reads
# its weights, from L2 past the first); cuBLAS's GEMM above
SHARED_DECODE_MAX_T = 16


def shared_expert(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor | None:
    """A shared expert (dense SwiGLU, gate_up [2I, H] rows [gate | up], down [H, I]) on
    decode-sized x [T, H] in two Triton launches on CUDA, or None (the caller runs the MLP)."""
    mod = dispatch.triton_for(x, "fused_moe")
    if mod is None or x.shape[0] > SHARED_DECODE_MAX_T:
        return None
    return mod.shared_expert_decode(x, gate_up, down)
