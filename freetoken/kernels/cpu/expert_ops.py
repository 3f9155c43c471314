"""CPU expert computation: per (token, k) unweighted SwiGLU expert outputs.

Shape legend: T tokens, K routed experts per token, E experts, H hidden, I intermediate.

Bank layout (the runtime layout of the host expert pool, DESIGN §4):
  gate_up [E, 2I, H]  rows 0..I-1 = gate, rows I..2I-1 = up
  down    [E, H, I]
  y[t, k] = down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = topk_ids[t, k]

The outputs are *unweighted*: the caller merges `sum_k w[t, k] * y[t, k]` itself, so partial
sums computed on the GPU and on the CPU combine exactly. Entries whose `compute_mask` is False
are not written (their `out` rows keep whatever they held; a fresh `out` starts at zero).

Two implementations compute the same function, tested against the one expert oracle
(freetoken/kernels/reference.py, float64):
  cpu_experts_torch  grouped F.linear in the weights' dtype (torch's own bf16 path).
  cpu_experts        the C++ kernel (freetoken/kernels/cpu/expert_kernel.cpp) when it builds and the
                     dtypes are supported, else cpu_experts_torch.
Both take an `act` (freetoken/kernels/expert_act.py): gpt-oss's biased SwiGLU (the dense C++
kernel has no biases: the torch path then) or DeepSeek-V4's clamp (every path).

Quantized banks (`freetoken.kernels.quant.QuantBank`: FP8 block-scaled, MXFP4) go to the C++ kernel
freetoken/kernels/cpu/expert_quant.cpp, which reads them as stored and converts in registers (H and
I multiples of 32, fp8 blocks too); cpu_experts_torch dequantizes each routed expert instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken.kernels.expert_act import ExpertAct, act_code, expert_bias_row, glu
from freetoken.kernels.logs import get_logger
from freetoken.kernels.quant import QuantBank, as_weight

log = get_logger("experts")

_KERNEL_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


def _check_shapes(
    x: Tensor, topk_ids: Tensor, gate_up: Tensor, down: Tensor, compute_mask: Tensor | None
) -> tuple[int, int, int, int, int]:
    """Validate shapes; returns (T, K, E, H, I)."""
    if x.dim() != 2 or topk_ids.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError("expected x [T,H], topk_ids [T,K], gate_up [E,2I,H], down [E,H,I]")
    t, h = x.shape
    e, two_i, h2 = gate_up.shape
    i = two_i // 2
    if topk_ids.shape[0] != t or h2 != h or two_i != 2 * i or tuple(down.shape) != (e, h, i):
        raise ValueError(
            f"shape mismatch: x={tuple(x.shape)} topk_ids={tuple(topk_ids.shape)} "
            f"gate_up={tuple(gate_up.shape)} down={tuple(down.shape)}"
        )
    k = topk_ids.shape[1]
    if compute_mask is not None and tuple(compute_mask.shape) != (t, k):
        raise ValueError(f"compute_mask {tuple(compute_mask.shape)} != {(t, k)}")
    return t, k, e, h, i


def _prepare_out(out: Tensor | None, t: int, k: int, h: int) -> Tensor:
    if out is None:
        return torch.zeros(t, k, h, dtype=torch.float32)
    if tuple(out.shape) != (t, k, h) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{t},{k},{h}] tensor")
    return out


def _groups(topk_ids: Tensor, compute_mask: Tensor | None) -> list[tuple[int, Tensor]]:
    """Unique experts among computed entries, each with its flat (t*K + k) entry indices."""
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    entries = torch.arange(flat_ids.numel())  # [T*K]
    if compute_mask is not None:
        keep = compute_mask.reshape(-1).bool()
        flat_ids, entries = flat_ids[keep], entries[keep]
    if flat_ids.numel() == 0:
        return []
    order = torch.argsort(flat_ids, stable=True)
    ids_sorted, entries_sorted = flat_ids[order], entries[order]
    uniq, counts = torch.unique_consecutive(ids_sorted, return_counts=True)
    return list(zip(uniq.tolist(), torch.split(entries_sorted, counts.tolist())))


def cpu_experts_torch(
    x: Tensor,
    topk_ids: Tensor,
    gate_up: Tensor,
    down: Tensor,
    compute_mask: Tensor | None = None,
    out: Tensor | None = None,
    act: ExpertAct | None = None,
) -> Tensor:
    """Grouped F.linear in the weights' dtype: each routed expert's weights are used once for
    all tokens routed to it. Activations are cast to the weights' dtype (torch's bf16 path),
    so bf16 weights give bf16-operand accuracy. Returns `out` (float32 [T, K, H]). `act`:
    gpt-oss's biases and clamped SwiGLU bound to the logical ids, or DeepSeek-V4's clamp
    (freetoken/kernels/expert_act.py)."""
    t, k, e_count, h, _ = _check_shapes(x, topk_ids, gate_up, down, compute_mask)
    out = _prepare_out(out, t, k, h)
    out_flat = out.view(t * k, h)  # [T*K, H]
    wdt = torch.float32 if isinstance(gate_up, QuantBank) else gate_up.dtype
    for e, entries in _groups(topk_ids, compute_mask):
        if not 0 <= e < e_count:
            raise IndexError(f"expert id {e} out of range [0, {e_count})")
        xs = x[entries // k].to(wdt)  # [n, H]
        gb, db = expert_bias_row(act, int(entries[0]), wdt)  # [2I], [H] or None
        gu = F.linear(xs, as_weight(gate_up[e], wdt), gb).float()  # [n, 2I]
        a = glu(gu, act)  # [n, I]
        out_flat[entries] = F.linear(a.to(wdt), as_weight(down[e], wdt), db).float()  # [n, H]
    return out


def cpu_experts(
    x: Tensor,
    topk_ids: Tensor,
    gate_up: Tensor,
    down: Tensor,
    compute_mask: Tensor | None = None,
    out: Tensor | None = None,
    num_threads: int | None = None,
    act: ExpertAct | None = None,
) -> Tensor:
    """Unweighted expert outputs for every (t, k) with compute_mask True (all when None).

    x float (any float dtype, used as float32), topk_ids integer [T, K] in [0, E), weights
    bf16 or fp32 (both banks the same dtype). Returns float32 [T, K, H]: `out` when given (only
    masked-in rows are written), else a new zero tensor. Uses the C++ kernel when it is
    available for this CPU and dtype, else grouped F.linear. The GIL is released while the
    kernel runs, so a Python thread can drive the GPU copy stream meanwhile. `act`
    (freetoken/kernels/expert_act.py): the quantized kernel applies either kind; the dense one
    "clamp" (no biases), while dense banks with gpt-oss's biased act take the torch path.
    """
    from freetoken.kernels.cpu.ext import load_kernel

    t, k, _, h, _ = _check_shapes(x, topk_ids, gate_up, down, compute_mask)
    kern = load_kernel()
    if isinstance(gate_up, QuantBank):
        # (a build older than expert_quant.cpp lacks the symbol: the torch path then)
        if (kern is None or not _quant_usable(gate_up, down)
                or not hasattr(kern.lib, "ft_cpu_experts_q")):
            return cpu_experts_torch(x, topk_ids, gate_up, down, compute_mask, out, act)
        out = _prepare_out(out, t, k, h)
        run_quant(kern, x, topk_ids, gate_up, down, compute_mask, out, num_threads, act)
        return out
    usable = (
        (act is None or not act.has_bias)
        and kern is not None
        and gate_up.dtype in _KERNEL_WEIGHT_DTYPES
        and down.dtype == gate_up.dtype
        and gate_up.device.type == "cpu"
    )
    if not usable:
        return cpu_experts_torch(x, topk_ids, gate_up, down, compute_mask, out, act)
    assert kern is not None
    out = _prepare_out(out, t, k, h)
    kern.run(x, topk_ids, gate_up, down, compute_mask, out, num_threads, act=act)
    return out


_QUANT_MAX_DIM = 32 * 1024  # expert_quant.cpp: 32 * kMaxScales columns a row at most


def _quant_usable(gate_up: QuantBank, down: QuantBank) -> bool:
    """Whether expert_quant.cpp takes these banks: one format, on the CPU, H and I multiples of
    32 (one scale step) and at most 32768, fp8 blocks multiples of 32 too."""
    _, two_i, h = gate_up.shape
    return (isinstance(down, QuantBank) and down.fmt == gate_up.fmt
            and down.block == gate_up.block and gate_up.device.type == "cpu"
            and (gate_up.halves, down.halves) == (2, 1)
            and h % 32 == 0 and (two_i // 2) % 32 == 0 and gate_up.block % 32 == 0
            and max(h, two_i // 2) <= _QUANT_MAX_DIM)


def run_quant(kern, x: Tensor, topk_ids: Tensor, gate_up: QuantBank, down: QuantBank,
              compute_mask: Tensor | None, out: Tensor, num_threads: int | None = None,
              act: ExpertAct | None = None) -> None:
    """Fill `out` [T, K, H] fp32 for masked-in entries from quantized banks through
    `ft_cpu_experts_q` (shapes checked by the caller, `_quant_usable` true); `act`: gpt-oss's
    biases (fp32 in the kernel) and clamped SwiGLU, bound to the logical ids, or DeepSeek-V4's
    clamp (no biases)."""
    import ctypes

    fn = kern.lib.ft_cpu_experts_q
    if fn.argtypes is None:
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.restype = c_int
        fn.argtypes = [p, i64, i64, p, i64, p, p, p, p, p, i64, i64, c_int, i64, p, c_int,
                       p, p, p, ctypes.c_float, ctypes.c_float, c_int]
    t, h = x.shape
    e, two_i, _ = gate_up.shape
    xs = x.detach().to(torch.float32).contiguous()  # [T, H]
    ids = topk_ids.to(torch.int64).contiguous()  # [T, K]
    mask = None if compute_mask is None else compute_mask.to(torch.uint8).contiguous()
    gu, dn = gate_up.contiguous(), down.contiguous()
    nth = num_threads if num_threads is not None else torch.get_num_threads()
    bias = (None, None, None, 1.0, 0.0 if act is None else float(act.limit))
    if act is not None and act.has_bias:  # (kept alive in `held` for the call)
        held = (act.gate_up_bias.detach().float().contiguous(),
                act.down_bias.detach().float().contiguous(),
                act.entry_ids().to(torch.int64).contiguous())
        bias = (*(h_.data_ptr() for h_ in held), act.alpha, act.limit)
    rc = fn(xs.data_ptr(), t, h, ids.data_ptr(), topk_ids.shape[1],
            None if mask is None else mask.data_ptr(), gu.data.data_ptr(), gu.scale.data_ptr(),
            dn.data.data_ptr(), dn.scale.data_ptr(), e, two_i // 2,
            0 if gate_up.fmt == "fp8" else 1, gate_up.block, out.data_ptr(), nth, *bias,
            act_code(act))
    if rc == 1:
        raise IndexError(f"expert id out of range [0, {e})")
    if rc != 0:
        raise RuntimeError(f"ft_cpu_experts_q failed rc={rc}")
