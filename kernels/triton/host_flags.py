"""Flags in pinned host memory that a captured CUDA graph raises and waits on, so a decode step
can hand work to a host thread and take its result back without the host touching the stream
(the CPU expert branch of the hybrid backend, freetoken/experts/cpu_bridge.py).

Pinned host memory is mapped into the device's address space (UVA), so a kernel can store to
and load from it directly. `raise_flag` stores the step's sequence number into `flags[i]`;
stream order puts it after the copies that fed the host. `wait_flag` spins one program on a
volatile load of `flags[i]` until it equals the sequence number (unless the layer's `need`
mask is empty: then it returns at once), or until a bounded number of polls
passes: then it records the failure in `err` and returns, so a dead host thread costs a wrong
step the runner reports, not a hung GPU).

Shapes: flags [L] int64 (pinned host), seq [1] int64 (device), err [1] int32 (device).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

# a poll is one PCIe round trip (assumed ~1 µs, not measured): about half a second before a
# wait gives up
MAX_POLLS = 1 << 19


@triton.jit
def _raise_kernel(flags_ptr, seq_ptr, i):
    tl.store(flags_ptr + i, tl.load(seq_ptr))


@triton.jit
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


def raise_flag(flags: Tensor, i: int, seq: Tensor) -> None:
    """flags[i] = seq[0], ordered after the stream's earlier work."""
    _raise_kernel[(1,)](flags, seq, i)


def wait_flag(flags: Tensor, i: int, seq: Tensor, err: Tensor, need: Tensor | None = None,
              max_polls: int = MAX_POLLS) -> None:
    """Hold the stream until flags[i] == seq[0] (err[0] = 1 if it never comes); with `need`
    (a device bool/int tensor, e.g. the layer's CPU mask), only when some entry is set: a layer
    that gave the host no work does not wait for its answer."""
    if need is None:
        need = seq  # the sequence number is never 0 during a step: always wait
    flat = need.reshape(-1)
    _wait_kernel[(1,)](flags, seq, err, i, max_polls, flat, flat.numel(),
                       BLOCK=triton.next_power_of_2(max(1, flat.numel())))
