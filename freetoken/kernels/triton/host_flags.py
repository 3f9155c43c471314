"""Flags in pinned host memory that a captured CUDA graph raises and waits on, so a decode step
can hand work to a host thread and take its result back without the host touching the stream
(the CPU expert branch of the hybrid backend, freetoken/experts/bridge.py).

Pinned host memory is mapped into the device's address space (UVA), so a kernel can store to
and load from it directly. `raise_flag` stores the step's sequence number into `flags[i]`;
stream order puts it after the copies that fed the host. `wait_flag` spins one program on a
volatile load of `flags[i]` until it equals the sequence number (unless the layer's `need`
mask is empty: then it returns at once), or until a bounded number of polls
passes: then it records the failure in `err` and returns, so a dead host thread costs a wrong
step the runner reports, not a hung GPU).

`store_rows` writes a layer's inputs (x, ids, mask) into the pinned buffers the host reads, and
`merge_rows` reads the host's results back into the rows of `y` its mask selects (volatile loads:
never a cached copy of an earlier step's buffer): one kernel each where copy nodes and a
`where` took four graph nodes per layer, every one a switch between the copy engine and the SMs.

Shapes: flags [L] int64 (pinned host), seq [1] int64 (device), err [1] int32 (pinned host);
x [T, H], ids / mask [T, K], y and the host results [T, K, H].
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

# a poll is one PCIe round trip (assumed ~1 µs, not measured): about half a second before a
# wait gives up
MAX_POLLS = 1 << 19


@triton.jit(do_not_specialize=["i"])  # sizes/indices: 1 compile
def _raise_kernel(flags_ptr, seq_ptr, i):
    tl.store(flags_ptr + i, tl.load(seq_ptr))


@triton.jit(do_not_specialize=["i", "max_polls", "n_need"])  # sizes/indices: 1 compile
def _wait_kernel(flags_ptr, seq_ptr, err_ptr, i, max_polls, need_ptr, n_need,
                 BLOCK: tl.constexpr):
    seq = tl.load(seq_ptr)
    offs = tl.arange(0, BLOCK)
    need = tl.sum(tl.load(need_ptr + offs, mask=offs < n_need, other=0).to(tl.int32))
    seen = tl.load(flags_ptr + i, volatile=True)
    n = 0
    while (need > 0) & (seen != seq) & (n < max_polls):
        seen = tl.load(flags_ptr + i, volatile=True)
        n += 1
    if (need > 0) & (seen != seq):
        tl.store(err_ptr, 1)


@triton.jit(do_not_specialize=["n_x", "n_k"])  # sizes/indices: 1 compile
def _store_rows_kernel(x_ptr, hx_ptr, n_x, ids_ptr, hids_ptr, mask_ptr, hmask_ptr, n_k,
                       BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(hx_ptr + o, tl.load(x_ptr + o, mask=o < n_x), mask=o < n_x)
    if pid == 0:
        k = tl.arange(0, BLOCK_K)
        tl.store(hids_ptr + k, tl.load(ids_ptr + k, mask=k < n_k), mask=k < n_k)
        tl.store(hmask_ptr + k, tl.load(mask_ptr + k, mask=k < n_k), mask=k < n_k)


@triton.jit
def _merge_rows_kernel(y_ptr, host_ptr, mask_ptr, H, BLOCK_H: tl.constexpr):
    r = tl.program_id(0)  # one (token, k) row
    if tl.load(mask_ptr + r):
        for h0 in range(0, H, BLOCK_H):
            o = h0 + tl.arange(0, BLOCK_H)
            v = tl.load(host_ptr + r * H + o, mask=o < H, volatile=True)
            tl.store(y_ptr + r * H + o, v, mask=o < H)


def store_rows(x: Tensor, ids: Tensor, mask: Tensor, hx: Tensor, hids: Tensor,
               hmask: Tensor) -> None:
    """hx, hids, hmask (pinned host, contiguous) = x [T, H], ids [T, K], mask [T, K]."""
    x, ids, mask = x.to(hx.dtype).contiguous(), ids.to(hids.dtype).contiguous(), mask.contiguous()
    n_x, n_k = x.numel(), ids.numel()
    block = 1024
    _store_rows_kernel[(triton.cdiv(n_x, block),)](
        x, hx, n_x, ids, hids, mask, hmask, n_k, BLOCK=block,
        BLOCK_K=triton.next_power_of_2(max(1, n_k)))


def merge_rows(y: Tensor, host: Tensor, mask: Tensor) -> Tensor:
    """y[t, k] = host[t, k] where mask[t, k], in place; y [T, K, H] contiguous on the device,
    host [T, K, H] pinned. Returns y."""
    T, K, H = y.shape
    _merge_rows_kernel[(T * K,)](y, host, mask.contiguous(), H,
                                 BLOCK_H=min(1024, triton.next_power_of_2(H)))
    return y


def raise_flag(flags: Tensor, i: int, seq: Tensor) -> None:
    """flags[i] = seq[0], ordered after the stream's earlier work."""
    _raise_kernel[(1,)](flags, seq, i)


def wait_flag(flags: Tensor, i: int, seq: Tensor, err: Tensor, need: Tensor,
              max_polls: int = MAX_POLLS) -> None:
    """Hold the stream until flags[i] == seq[0] (err[0] = 1 if it never comes), when some entry
    of `need` (a device bool/int tensor: the layer's CPU mask) is set: a layer that gave the
    host no work does not wait for its answer."""
    flat = need.reshape(-1)
    _wait_kernel[(1,)](flags, seq, err, i, max_polls, flat, flat.numel(),
                       BLOCK=triton.next_power_of_2(max(1, flat.numel())))
