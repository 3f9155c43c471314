"""Grouped (prefill) path of `fused_moe`: entries sorted by bank row, one tl.dot GEMM per block.

Shape legend: T tokens, K top-k, H hidden, I expert intermediate, S bank rows, N = T*K entries,
BM = BLOCK_M, P = padded length N + min(N, S)*(BM-1) (an upper bound fixed by the shapes).

`moe_align` is a torch equivalent of vLLM's `moe_align_block_size`: each bank row's entries are
laid out contiguously, padded to a multiple of BM, so every BM-block belongs to one row. It is
about 25 small device ops (scatter_add, cumsum, a stable argsort, searchsorted) with no Python
loop over experts and no host read: the grid is sized from P, and blocks past the real padded
total (read on the device) exit at once. So prefill pays those launches and no sync. For
decode-sized N (<= 128 entries) `moe_align_small` computes the same three tensors in one
Triton program (pairwise ranks, a histogram, a cumsum), so a batch of 4-16 tokens can take the
grouped path (each distinct expert read once) for one extra launch instead of ~25.

The gate_up kernel computes the gate and the up columns of the same rows i in one program (two
accumulators) so SiLU(gate)*up happens in its epilogue; vLLM writes [N, 2I] and runs a
separate silu_and_mul (`act=`, freetoken/kernels/expert_act.py, in the same epilogue under
the ACT constexpr: gpt-oss's biases and clamped SwiGLU, its down bias in the down kernel's;
DeepSeek-V4's clamp). The intermediate [N, I] is in the model
dtype (bf16 tensor cores for the down GEMM, as vLLM); in fp32 it is fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken.kernels.expert_act import ExpertAct, act_code
from freetoken.kernels.triton.moe_common import (
    _bias_down_2d,
    _bias_gu_2d,
    _block,
    _glu,
    act_args,
    check_args,
    interpreting,
)


def tile(bm: int, bn: int, bk: int, group_m: int, warps: int, stages: int) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
            "num_warps": warps, "num_stages": stages}


# Per-T configs for the H200 at H=2048, I=512, E=256 (bf16), from SGLang's tuned
# `E=256,N=512,device_name=NVIDIA_H200{,_down}.json` (T <= 256, 512, 1024) and, past 1024
# tokens, its `E=128,N=512` H200 entry at the same tokens per expert (T=2048 there). Our
# gate_up BLOCK_N counts row pairs (gate and up), so it is half of SGLang's N tile.
# (max T, gate_up tile, down tile); tile = (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages).
# The gate_up tile's BLOCK_M is used by both kernels (the padding of the sorted entries).
GROUPED_CONFIGS: list[tuple[int, dict, dict]] = [
    (256, tile(16, 16, 64, 1, 4, 3), tile(16, 32, 64, 1, 4, 3)),
    (512, tile(32, 64, 128, 32, 8, 3), tile(32, 64, 128, 32, 4, 3)),
    (1024, tile(64, 32, 64, 1, 4, 3), tile(64, 128, 64, 1, 4, 3)),
    (1 << 62, tile(128, 128, 64, 32, 8, 3), tile(128, 128, 64, 32, 8, 3)),
]


def grouped_config(T: int) -> tuple[dict, dict]:
    for max_t, gu, dn in GROUPED_CONFIGS:
        if T <= max_t:
            return gu, dn
    raise AssertionError("unreachable: the last entry has no limit")


def moe_align(ids: Tensor, num_rows: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sort the N = ids.numel() entries by bank row, each row's run padded to block_m.

    Returns sorted_entries [P] (entry index, or N for padding), block_row [cdiv(P, BM)] (the bank
    row of each block, -1 past the end) and total [1] (padded length actually used, on device).
    Entries with id < 0 are left out. Stable: a row's entries keep their (t, k) order.
    """
    flat = ids.reshape(-1).to(torch.int64)  # [N]
    N, dev = flat.numel(), flat.device
    P = N + min(N, num_rows) * (block_m - 1)
    key = torch.where(flat >= 0, flat, num_rows)  # [N]; left-out entries -> bucket S
    counts = torch.zeros(num_rows + 1, dtype=torch.int64, device=dev)  # [S+1]
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m  # [S+1]
    padded[num_rows:].zero_()  # a fill kernel: `[i] = 0` copies a host scalar (a sync)
    pad_end = torch.cumsum(padded, 0)  # [S+1]
    pad_start = pad_end - padded  # [S+1]
    run_start = torch.cumsum(counts, 0) - counts  # [S+1] unpadded
    order = torch.argsort(key, stable=True)  # [N] entries grouped by row
    skey = key[order]  # [N]
    pos = pad_start[skey] + torch.arange(N, device=dev) - run_start[skey]  # [N]
    pos = torch.where(skey < num_rows, pos, P)  # left-out entries land on a dropped tail slot
    sorted_entries = torch.full((P + 1,), N, dtype=torch.int64, device=dev)  # [P+1]
    sorted_entries.scatter_(0, pos, order)
    starts = torch.arange(0, P, block_m, device=dev)  # [cdiv(P, BM)]
    total = pad_end[num_rows - 1:num_rows]  # [1]
    block_row = torch.searchsorted(pad_end[:num_rows], starts, right=True)  # [cdiv(P, BM)]
    block_row = torch.where(starts < total, block_row, -1)
    return sorted_entries[:P], block_row, total


@triton.jit(do_not_specialize=["N", "P", "NB"])  # sizes/indices: 1 compile
def _align_small_kernel(
    ids_ptr, sorted_ptr, block_row_ptr, total_ptr, pad_start_ptr,
    N, S, P, NB,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
):
    """`moe_align` in one program for decode-sized N (the torch version is ~25 tiny launches)."""
    i = tl.arange(0, BLOCK_N)  # [BN] entries
    r = tl.arange(0, BLOCK_S)  # [BS] bank rows, BLOCK_S > S: bin S collects the left-out
    key = tl.load(ids_ptr + i, mask=i < N, other=-1).to(tl.int32)
    valid = (i < N) & (key >= 0)
    key = tl.where(valid, key, S)
    # rank of an entry among the earlier entries of its row: stable, as the torch argsort
    before = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None])  # [BN, BN]
    rank = tl.sum(before.to(tl.int32), axis=1)  # [BN]
    counts = tl.where(r < S, tl.histogram(key, BLOCK_S), 0)  # [BS]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)  # [BS]
    tl.store(pad_start_ptr + r, pad_end - padded)
    tl.store(total_ptr, tl.sum(padded, 0).to(tl.int64))
    for p0 in range(0, P, CHUNK):
        o = p0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + o, tl.zeros([CHUNK], dtype=tl.int64) + N, mask=o < P)
        tl.store(block_row_ptr + o, tl.full([CHUNK], -1, tl.int64), mask=o < NB)
    tl.debug_barrier()  # the fills and pad_start are visible to every thread from here
    pos = tl.load(pad_start_ptr + key, mask=valid, other=0) + rank  # [BN]
    tl.store(sorted_ptr + pos, i.to(tl.int64), mask=valid)
    # every block of a row's padded run holds at least one of its entries
    tl.store(block_row_ptr + pos // BLOCK_M, key.to(tl.int64), mask=valid)


# decode-sized alignments run in one program: N entries compared pairwise, S+1 histogram bins
ALIGN_SMALL_MAX_N, ALIGN_SMALL_MAX_S = 128, 4095


def moe_align_small(ids: Tensor, num_rows: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """The same outputs as `moe_align` (bit for bit), in one launch; N <= 128, S <= 4095."""
    flat = ids.reshape(-1)  # [N]
    if not flat.is_contiguous():
        flat = flat.contiguous()
    N, dev = flat.numel(), flat.device
    if N > ALIGN_SMALL_MAX_N or num_rows > ALIGN_SMALL_MAX_S:
        raise ValueError(f"moe_align_small: N={N} or S={num_rows} too large")
    P = N + min(N, num_rows) * (block_m - 1)
    NB = triton.cdiv(P, block_m)
    sorted_entries = torch.empty((P,), dtype=torch.int64, device=dev)  # [P]
    block_row = torch.empty((NB,), dtype=torch.int64, device=dev)  # [NB]
    total = torch.empty((1,), dtype=torch.int64, device=dev)  # [1]
    block_s = triton.next_power_of_2(num_rows + 1)
    pad_start = torch.empty((block_s,), dtype=torch.int32, device=dev)  # [BS] scratch
    _align_small_kernel[(1,)](
        flat, sorted_entries, block_row, total, pad_start, N, num_rows, P, NB,
        BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_S=block_s,
        CHUNK=1024, num_warps=4,
    )
    return sorted_entries, block_row, total


@triton.jit
def _tile_ids(pid, P, NCOLS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped program order (as in the Triton matmul tutorial and vLLM) for L2 reuse of x."""
    num_m = tl.cdiv(P, BLOCK_M)
    num_n = tl.cdiv(NCOLS, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    return pid_m, pid_n


@triton.jit(do_not_specialize=["N", "P"])  # sizes/indices: 1 compile
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, a_ptr, sorted_ptr, block_row_ptr, total_ptr, lid_ptr, gub_ptr,
    N, P, H, I, TOPK, alpha, limit,
    stride_xt, stride_we, stride_wn, stride_an, stride_gub,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ACT: tl.constexpr,
):
    """a[ent, i] for a block of one bank row's entries; ACT selects `_glu`, ACT 1 (gpt-oss)
    adding gate_up_bias[lid[ent]] (each entry's logical expert) first."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), P, I, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    row = tl.load(block_row_ptr + pid_m).to(tl.int64)
    ent = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    ent_ok = ent < N
    tok = ent // TOPK
    i = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    i_ok = i < I
    kk = tl.arange(0, BLOCK_K)  # [BK]
    x_ptrs = x_ptr + tok[:, None] * stride_xt + kk[None, :]  # [BM, BK]
    g_ptrs = w_ptr + row * stride_we + i[None, :] * stride_wn + kk[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            xa = tl.load(x_ptrs + k0, mask=ent_ok[:, None], other=0.0)
            g = tl.load(g_ptrs + k0, mask=i_ok[None, :], other=0.0)
            u = tl.load(u_ptrs + k0, mask=i_ok[None, :], other=0.0)
        else:
            k_ok = k0 + kk < H
            xa = tl.load(x_ptrs + k0, mask=ent_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs + k0, mask=k_ok[:, None] & i_ok[None, :], other=0.0)
            u = tl.load(u_ptrs + k0, mask=k_ok[:, None] & i_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong (MODEL_FACTS §3)
            xa, g, u = xa.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(xa, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(xa, u, acc_u, input_precision=PRECISION)
    if ACT == 1:  # gpt-oss: biases by logical id
        acc_g, acc_u = _bias_gu_2d(acc_g, acc_u, lid_ptr, gub_ptr, ent, ent_ok, i, i_ok, I,
                                   stride_gub)
    act = _glu(acc_g, acc_u, alpha, limit, ACT)  # [BM, BN]
    a_ptrs = a_ptr + ent[:, None] * stride_an + i[None, :]
    tl.store(a_ptrs, act.to(a_ptr.dtype.element_ty), mask=ent_ok[:, None] & i_ok[None, :])


@triton.jit(do_not_specialize=["N", "P"])  # sizes/indices: 1 compile
def _grouped_down_kernel(
    a_ptr, w_ptr, y_ptr, sorted_ptr, block_row_ptr, total_ptr, lid_ptr, db_ptr,
    N, P, H, I, TOPK,
    stride_an, stride_we, stride_wn, stride_yt, stride_yk, stride_yh, stride_db,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ACT: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), P, H, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    row = tl.load(block_row_ptr + pid_m).to(tl.int64)
    ent = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    ent_ok = ent < N
    h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    h_ok = h < H
    kk = tl.arange(0, BLOCK_K)  # [BK]
    a_ptrs = a_ptr + ent[:, None] * stride_an + kk[None, :]  # [BM, BK]
    w_ptrs = w_ptr + row * stride_we + h[None, :] * stride_wn + kk[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            av = tl.load(a_ptrs + k0, mask=ent_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=h_ok[None, :], other=0.0)
        else:
            k_ok = k0 + kk < I
            av = tl.load(a_ptrs + k0, mask=ent_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & h_ok[None, :], other=0.0)
        if UPCAST:
            av, w = av.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(av, w, acc, input_precision=PRECISION)
    if ACT == 1:  # gpt-oss: biases by logical id
        acc = _bias_down_2d(acc, lid_ptr, db_ptr, ent, ent_ok, h, h_ok, stride_db)
    tok = ent // TOPK
    k = ent % TOPK
    y_ptrs = y_ptr + tok[:, None] * stride_yt + k[:, None] * stride_yk + h[None, :] * stride_yh
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ent_ok[:, None] & h_ok[None, :])



class GroupedSetup(NamedTuple):
    """What both grouped launches (dense and quantized) share: the tile configs, the
    interpreter's upcast, the dot precision, BLOCK_M and the sorted entries."""

    cu: dict
    cd: dict
    upcast: bool
    prec: str | None
    bm: int
    sorted_entries: Tensor  # [P]
    block_row: Tensor  # [cdiv(P, BM)]
    total: Tensor  # [1]


def grouped_setup(x: Tensor, ids: Tensor, S: int, config: tuple[dict, dict] | None
                  ) -> GroupedSetup:
    T, K = ids.shape
    N = T * K
    cu, cd = grouped_config(T) if config is None else config
    upcast = interpreting() and x.dtype != torch.float32
    # fp32 operands stay exact ("ieee"), not tf32: fp32 runs are the bit-level test oracle
    prec = "ieee" if x.dtype == torch.float32 or upcast else None
    # both kernels must agree on BLOCK_M: it is the padding granularity of the sorted entries
    bm = max(16, min(cu["BLOCK_M"], triton.next_power_of_2(N)))
    small = N <= ALIGN_SMALL_MAX_N and S <= ALIGN_SMALL_MAX_S
    align = moe_align_small if small else moe_align
    return GroupedSetup(cu, cd, upcast, prec, bm, *align(ids, S, bm))


def fused_moe_grouped(x: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, y: Tensor,
                      config: tuple[dict, dict] | None = None, *,
                      act: ExpertAct | None = None) -> Tensor:
    """The grouped path. `config` = (gate_up cfg, down cfg) overrides `grouped_config(T)`.
    `act`: gpt-oss's biases (by the entries' logical ids) and clamped SwiGLU, or
    DeepSeek-V4's clamp."""
    T, K, H, I = check_args(x, ids, gate_up, down, y)
    N, S = T * K, gate_up.shape[0]
    if N == 0:
        return y
    cu, cd, upcast, prec, bm, sorted_entries, block_row, total = grouped_setup(x, ids, S, config)
    P = sorted_entries.numel()
    lid, gub, db, alpha, limit, s_gub, s_db = act_args(act, x, N)
    a = torch.empty((N, I), dtype=x.dtype, device=x.device)  # [N, I] SwiGLU output
    bn, bk = _block(cu["BLOCK_N"], I, 16), _block(cu["BLOCK_K"], H, 16)
    grid = (triton.cdiv(P, bm) * triton.cdiv(I, bn),)
    _grouped_gate_up_kernel[grid](
        x, gate_up, a, sorted_entries, block_row, total, lid, gub,
        N, P, H, I, K, alpha, limit,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), a.stride(0), s_gub,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cu["GROUP_M"],
        EVEN_K=H % bk == 0, UPCAST=upcast, PRECISION=prec, ACT=act_code(act),
        num_warps=cu["num_warps"], num_stages=cu["num_stages"],
    )
    bn, bk = _block(cd["BLOCK_N"], H, 16), _block(cd["BLOCK_K"], I, 16)
    grid = (triton.cdiv(P, bm) * triton.cdiv(H, bn),)
    _grouped_down_kernel[grid](
        a, down, y, sorted_entries, block_row, total, lid, db,
        N, P, H, I, K,
        a.stride(0), down.stride(0), down.stride(1), y.stride(0), y.stride(1), y.stride(2),
        s_db,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cd["GROUP_M"],
        EVEN_K=I % bk == 0, UPCAST=upcast, PRECISION=prec, ACT=act_code(act),
        num_warps=cd["num_warps"], num_stages=cd["num_stages"],
    )
    return y
