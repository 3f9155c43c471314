"""Fused MoE on the GPU: routed experts read in place through bank row ids, SwiGLU fused.

Shape legend: T tokens, K top-k, H hidden, I expert intermediate, S bank rows (slots, or
experts under `fused`), N = T*K (token, k) entries, entry n = t*K + k.

    fused_moe(x [T, H], ids [T, K], gate_up [S, 2I, H], down [S, H, I], y [T, K, H]) -> y
    y[t, k] = down[id] @ (silu(gate[id] @ x[t]) * (up[id] @ x[t])),  id = ids[t, k]

With `act=` (freetoken/kernels/expert_act.py) both paths select the activation by a constexpr
(ACT = `act_code(act)`): gpt-oss's "oai" (1) adds the biases of each entry's logical expert
(act.ids, not the bank row) around its clamped SwiGLU; DeepSeek-V4's "clamp" (2) clamps gate
and up, no biases. The plain SwiGLU's compiled kernels (ACT 0) are unchanged.

The same contract as `freetoken.layers.moe.dispatch_experts` (unweighted outputs; entries with
id < 0 are not computed and keep y's value, which the CPU branch of `hybrid` writes). The banks
are read through the ids, never gathered. fp32 accumulation throughout.

Two paths, picked by N (`decode=None`):
  decode  (N <= DECODE_MAX_ENTRIES) GEMV per entry, two kernels: gate_up rows + SiLU*up into an
          fp32 [N, I] intermediate, then the down rows. Grid (N, row blocks), fixed by the shapes;
          no sort, no host read: capturable in a CUDA graph. Each weight byte is read once per
          entry (a repeated expert within one step is read again; L2 may catch it since the
          grid runs entries fastest, so the same row block of every entry is in flight at once).
  grouped (larger N) entries sorted by bank row on the device (`moe_grouped.moe_align`), then a
          tl.dot grouped GEMM per (expert block of BLOCK_M entries, column block), as vLLM's
          `fused_moe_kernel`; each expert's weights are read once per row block of its entries.
          No host read either (the sort is on the device, the grid is sized from the shapes).

The decode path also takes the block's shared expert as T more entries (`shared=`, when its
intermediate size equals the routed one), and `shared_expert_decode` runs a shared expert alone
in the same two launches; `zero_missing` writes zeros for ids < 0, so y need not be cleared.
`moe_sum(y, w)` (freetoken/kernels/triton/decode_fusions.py, re-exported) is the weighted merge.
Under TRITON_INTERPRET=1 (CPU tests) everything runs in fp32 math; the grouped path upcasts
bf16 operands before tl.dot there, since the interpreter's bf16 dot is wrong.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken.kernels.expert_act import ExpertAct, act_code
from freetoken.kernels.triton.decode_fusions import moe_sum  # noqa: F401  (re-exported)
from freetoken.kernels.triton.moe_common import _block, _glu, act_args, check_args, interpreting
from freetoken.kernels.triton.tuned import lookup

# Above this many (token, k) entries the grouped path reads fewer weight bytes (repeated
# experts share a read) and its sort is affordable. To be re-measured on the H200:
# scripts/bench_triton_moe.py prints both paths at T=1, 4, 16.
DECODE_MAX_ENTRIES = 128

# The built-in decode tiles, for a GPU or shape without an entry in
# freetoken/kernels/triton/configs/
# (`decode_config`). Chosen on the H200 for H=2048, I=512 (bf16) and swept there with
# scripts/bench_triton_moe.py (docs/kernels.md: no config beat them beyond noise):
# T=1 gives 8 entries x 32 row blocks = 256 gate_up programs and 8 x 64 = 512 down programs
# (132 SMs), each streaming 16-byte vector loads along the contiguous H (or I) axis.
DECODE_CONFIG = {
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4},
    "down": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4},
}


def decode_config(x: Tensor, gate_up: Tensor) -> dict:
    """The decode tiles for x's GPU and the (H, I) of `gate_up` [S, 2I, H]: the entry of
    freetoken/kernels/triton/configs/<gpu>.json (freetoken/kernels/triton/tuned.py), else
    DECODE_CONFIG. Read at the first launch of each GPU and shape and kept; the built-in tiles
    under the interpreter."""
    index = x.device.index if x.is_cuda and not interpreting() else None
    return _decode_config(index, int(gate_up.shape[2]), int(gate_up.shape[1]) // 2)


@functools.cache
def _decode_config(device_index: int | None, H: int, I: int) -> dict:
    name = None if device_index is None else torch.cuda.get_device_name(device_index)
    return lookup("fused_moe_decode", f"H={H},I={I}", DECODE_CONFIG, name)


@triton.jit(do_not_specialize=["N"])  # sizes/indices: 1 compile
def _decode_gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, sw_ptr, a_ptr, lid_ptr, gub_ptr,
    H, I, TOPK, N, alpha, limit,
    stride_xt, stride_we, stride_wn, stride_swn, stride_an, stride_gub,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    ACT: tl.constexpr,
):
    """a[n, i] = silu(gate[id] @ x[t])[i] * (up[id] @ x[t])[i] for one entry n and BLOCK_N rows
    i. Entries n >= N are the shared expert's (weights at sw_ptr) for token t = n - N. ACT
    (routed entries only: no shared expert with an act) selects `moe_common._glu`; ACT 1
    (gpt-oss): gate/up += gate_up_bias[lid[n]] first, the bias row the entry's LOGICAL expert
    lid[n], not its bank row."""
    n = tl.program_id(0)
    pid_i = tl.program_id(1)
    routed = n < N
    row = tl.load(ids_ptr + n, mask=routed, other=0).to(tl.int64)
    if row < 0:
        return
    i = pid_i * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    kk = tl.arange(0, BLOCK_K)  # [BK]
    if routed:
        t = n // TOPK
        g_ptrs = w_ptr + row * stride_we + i[:, None] * stride_wn + kk[None, :]  # [BN, BK]
        u_ptrs = g_ptrs + I * stride_wn
    else:
        t = n - N
        g_ptrs = sw_ptr + i[:, None] * stride_swn + kk[None, :]  # [BN, BK]
        u_ptrs = g_ptrs + I * stride_swn
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_row + k0 + kk).to(tl.float32)  # [BK]
        else:
            xv = tl.load(x_row + k0 + kk, mask=k0 + kk < H, other=0.0).to(tl.float32)
        if EVEN_N and EVEN_K:
            g = tl.load(g_ptrs + k0)
            u = tl.load(u_ptrs + k0)
        else:
            m = (i[:, None] < I) & (k0 + kk[None, :] < H)
            g = tl.load(g_ptrs + k0, mask=m, other=0.0)
            u = tl.load(u_ptrs + k0, mask=m, other=0.0)
        acc_g += g.to(tl.float32) * xv[None, :]
        acc_u += u.to(tl.float32) * xv[None, :]
    gate = tl.sum(acc_g, axis=1)  # [BN]
    up = tl.sum(acc_u, axis=1)  # [BN]
    if ACT == 1:  # gpt-oss: biases by logical id
        gb = gub_ptr + tl.load(lid_ptr + n).to(tl.int64) * stride_gub + i  # [BN]
        gate += tl.load(gb, mask=i < I, other=0.0).to(tl.float32)
        up += tl.load(gb + I, mask=i < I, other=0.0).to(tl.float32)
    act = _glu(gate, up, alpha, limit, ACT)
    tl.store(a_ptr + n.to(tl.int64) * stride_an + i, act, mask=i < I)


@triton.jit(do_not_specialize=["N"])  # sizes/indices: 1 compile
def _decode_down_kernel(
    a_ptr, ids_ptr, w_ptr, sw_ptr, y_ptr, so_ptr, lid_ptr, db_ptr,
    H, I, TOPK, N,
    stride_an, stride_we, stride_wn, stride_swn, stride_yt, stride_yk, stride_yh, stride_so,
    stride_db,
    ZERO_MISSING: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    ACT: tl.constexpr,
):
    """y[t, k, h] = down[id][h] @ a[n] for one entry n = t*K + k < N and BLOCK_N rows h;
    so[t, h] = shared_down[h] @ a[n] for a shared entry n = N + t. An entry with id < 0 is
    written with zeros under ZERO_MISSING, else left alone. ACT 1: + down_bias[lid[n]]."""
    n = tl.program_id(0)
    pid_h = tl.program_id(1)
    routed = n < N
    row = tl.load(ids_ptr + n, mask=routed, other=0).to(tl.int64)
    h = pid_h * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    if routed:
        t = n // TOPK
        k = n % TOPK
        w_ptrs = w_ptr + row * stride_we + h[:, None] * stride_wn  # [BN, 1]
        y_ptrs = y_ptr + t.to(tl.int64) * stride_yt + k * stride_yk + h * stride_yh  # [BN]
    else:
        t = n - N
        w_ptrs = sw_ptr + h[:, None] * stride_swn
        y_ptrs = so_ptr + t.to(tl.int64) * stride_so + h
    if row < 0:
        if ZERO_MISSING:
            tl.store(y_ptrs, tl.zeros([BLOCK_N], dtype=tl.float32).to(y_ptr.dtype.element_ty),
                     mask=h < H)
        return
    kk = tl.arange(0, BLOCK_K)  # [BK]
    w_ptrs = w_ptrs + kk[None, :]  # [BN, BK]
    a_row = a_ptr + n.to(tl.int64) * stride_an
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            av = tl.load(a_row + k0 + kk)  # [BK] fp32
        else:
            av = tl.load(a_row + k0 + kk, mask=k0 + kk < I, other=0.0)
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs + k0)
        else:
            w = tl.load(w_ptrs + k0, mask=(h[:, None] < H) & (k0 + kk[None, :] < I), other=0.0)
        acc += w.to(tl.float32) * av[None, :]
    out = tl.sum(acc, axis=1)  # [BN]
    if ACT == 1:  # gpt-oss: biases by logical id
        db = db_ptr + tl.load(lid_ptr + n).to(tl.int64) * stride_db + h  # [BN]
        out += tl.load(db, mask=h < H, other=0.0).to(tl.float32)
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=h < H)


def fused_moe_decode(x: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, y: Tensor,
                     config: dict | None = None, *, zero_missing: bool = False,
                     shared: tuple[Tensor, Tensor, Tensor] | None = None,
                     act: ExpertAct | None = None) -> Tensor:
    """The decode (GEMV) path. `config` overrides the tuned tiles (`decode_config`; same
    keys). `zero_missing`: entries with id < 0 get zeros (the caller need not clear y first).
    `shared` = (gate_up [2I, H], down [H, I], out [T, H]): a shared expert with the routed
    experts' I, run on every token in the same two launches (T more entries), its unweighted
    output written to out. `act` (freetoken/kernels/expert_act.py): gpt-oss's biases and
    clamped SwiGLU, bound to the entries' logical ids [T, K] (ids are bank rows: slots under a
    slot cache), or DeepSeek-V4's clamp; not with `shared` (the block runs its own)."""
    T, K, _, _ = check_args(x, ids, gate_up, down, y)
    if act is not None and shared is not None:
        raise ValueError("fused_moe_decode: act with a shared expert is not supported")
    flat = ids.reshape(T * K)  # [N]
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if shared is not None:
        check_shared(x, gate_up, *shared)
        if shared[2].dtype != y.dtype:
            raise ValueError(f"shared output {shared[2].dtype} and y {y.dtype} differ")
    _decode_launch(x, flat, K, gate_up, down, y, shared, zero_missing,
                   decode_config(x, gate_up) if config is None else config, act)
    return y


def check_shared(x: Tensor, gate_up: Tensor, s_gate_up: Tensor, s_down: Tensor, out: Tensor
                 ) -> None:
    T, H = x.shape
    I = gate_up.shape[1] // 2
    if (tuple(s_gate_up.shape) != (2 * I, H) or tuple(s_down.shape) != (H, I)
            or tuple(out.shape) != (T, H)):
        raise ValueError(f"shared expert gate_up {tuple(s_gate_up.shape)}, down "
                         f"{tuple(s_down.shape)}, out {tuple(out.shape)} do not fit H={H}, I={I}")
    if s_gate_up.dtype != x.dtype or s_down.dtype != x.dtype or out.dtype != x.dtype:
        raise ValueError("the shared expert's weights and output need x's dtype")
    if s_gate_up.stride(1) != 1 or s_down.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("the shared expert's weights and output need a contiguous last dim")


def shared_expert_decode(x: Tensor, gate_up: Tensor, down: Tensor, out: Tensor | None = None,
                         config: dict | None = None) -> Tensor:
    """A dense SwiGLU MLP (a shared expert) on decode-sized x [T, H] in the decode kernels' two
    launches: out [T, H] = down @ (silu(gate @ x) * (up @ x)), gate_up [2I, H] rows
    [gate | up], down [H, I]; fp32 accumulation, out in x's dtype."""
    T, H = x.shape
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)  # [T, H]
    check_shared(x, gate_up[None], gate_up, down, out)
    no_ids = torch.empty(0, dtype=torch.int64, device=x.device)
    _decode_launch(x, no_ids, 1, gate_up[None], down[None], out[:, None], (gate_up, down, out),
                   False, decode_config(x, gate_up[None]) if config is None else config)
    return out


def _decode_launch(x: Tensor, flat: Tensor, K: int, gate_up: Tensor, down: Tensor, y: Tensor,
                   shared: tuple[Tensor, Tensor, Tensor] | None, zero_missing: bool,
                   cfg: dict, act: ExpertAct | None = None) -> None:
    """The two decode launches over N = flat.numel() routed entries plus T shared ones."""
    T, H = x.shape
    I = gate_up.shape[1] // 2
    N = flat.numel()
    sgu, sdn, so = shared if shared is not None else (gate_up, down, y)
    M = N + (T if shared is not None else 0)  # entries, shared last
    if M == 0:
        return
    if N == 0:  # a valid pointer for the (never taken) routed loads
        flat = torch.empty(1, dtype=torch.int64, device=x.device)
    lid, gub, db, alpha, limit, s_gub, s_db = act_args(act, x, N)
    a = torch.empty((M, I), dtype=torch.float32, device=x.device)  # [M, I] SwiGLU output
    c = cfg["gate_up"]
    bn, bk = _block(c["BLOCK_N"], I), _block(c["BLOCK_K"], H)
    _decode_gate_up_kernel[(M, triton.cdiv(I, bn))](
        x, flat, gate_up, sgu, a, lid, gub, H, I, K, N, alpha, limit,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), sgu.stride(0), a.stride(0), s_gub,
        BLOCK_N=bn, BLOCK_K=bk, EVEN_N=I % bn == 0, EVEN_K=H % bk == 0,
        ACT=act_code(act), num_warps=c.get("num_warps", 4),
    )
    c = cfg["down"]
    bn, bk = _block(c["BLOCK_N"], H), _block(c["BLOCK_K"], I)
    _decode_down_kernel[(M, triton.cdiv(H, bn))](
        a, flat, down, sdn, y, so, lid, db, H, I, K, N,
        a.stride(0), down.stride(0), down.stride(1), sdn.stride(0),
        y.stride(0), y.stride(1), y.stride(2), so.stride(0), s_db,
        ZERO_MISSING=zero_missing,
        BLOCK_N=bn, BLOCK_K=bk, EVEN_N=H % bn == 0, EVEN_K=I % bk == 0,
        ACT=act_code(act), num_warps=c.get("num_warps", 4),
    )


def fused_moe(x: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, y: Tensor, *,
              decode: bool | None = None, zero_missing: bool = False,
              act: ExpertAct | None = None) -> Tensor:
    """Fill y [T, K, H] with the unweighted expert outputs of every entry with ids >= 0; the
    others keep y's value, or get zeros with `zero_missing`.

    x [T, H] (bf16/fp16/fp32), ids [T, K] int32/int64 bank rows, gate_up [S, 2I, H] (rows
    [gate | up]), down [S, H, I], y [T, K, H] preallocated (any strides). decode: True for the
    GEMV path, False for the grouped path, None to pick by T*K <= DECODE_MAX_ENTRIES.
    Ids must be < S: that is not checked, since checking would read them back to the host.
    `act`: gpt-oss's or DeepSeek-V4's experts (see `fused_moe_decode`), on both paths.
    """
    if decode is None:
        decode = ids.numel() <= DECODE_MAX_ENTRIES
    if decode:
        return fused_moe_decode(x, ids, gate_up, down, y, zero_missing=zero_missing, act=act)
    from freetoken.kernels.triton.moe_grouped import fused_moe_grouped  # (lazy: only large batches)

    if zero_missing:
        y.zero_()  # the grouped kernels write only entries with ids >= 0
    return fused_moe_grouped(x, ids, gate_up, down, y, act=act)
