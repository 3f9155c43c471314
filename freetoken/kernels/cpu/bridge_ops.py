"""ctypes face of the bridge's step loop (freetoken/kernels/cpu/bridge_kernel.cpp): the CPU expert
branch of a whole decode step in one native call, driven by flags the GPU stores into mapped pinned
memory (the protocol is freetoken/experts/bridge.py's).

Shapes: L MoE layers, B rows of the bucket, K top-k, H hidden, E experts, I intermediate.
  x [L, B, H] fp32|bf16, ids [L, B, K] int64, mask [L, B, K] bool, out [L, B, K, H] as x,
  go, done [L] int64; gate_up[m] [E, 2I, H], down[m] [E, H, I]: one dtype, fp32 or bf16.
"""
from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import torch
from torch import Tensor

from freetoken.kernels.cpu.ext import CpuKernel

_WDTYPE = {torch.float32: 0, torch.bfloat16: 1}
_p, _i64, _int, _dbl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double


class StepStats(NamedTuple):
    wait_s: float  # thread 0 waiting for go flags (the GPU's part of the step)
    total_s: float  # the whole call
    max_wait_s: float
    max_wait_layer: int
    experts: int = 0  # distinct experts computed, summed over the layers

    @property
    def busy_s(self) -> float:
        """The call's time not spent waiting for the GPU: the CPU branch's own time."""
        return max(self.total_s - self.wait_s, 0.0)


def _bind(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_ft_bridge_bound", False):
        return
    lib.ft_bridge_new.restype = _p
    lib.ft_bridge_new.argtypes = [_i64, _i64, _i64, _i64, _i64, _i64, _int, _int, _p, _p, _p,
                                  _p, _p, _p, _p, _p, _int, _i64]
    lib.ft_bridge_free.restype = None
    lib.ft_bridge_free.argtypes = [_p]
    lib.ft_bridge_set_cpus.restype = None
    lib.ft_bridge_set_cpus.argtypes = [_p, _p, _int]
    lib.ft_bridge_set_throttle.restype = None
    lib.ft_bridge_set_throttle.argtypes = [_p, _i64]
    lib.ft_bridge_run_step.restype = _int
    lib.ft_bridge_run_step.argtypes = [_p, _i64, _i64, _dbl, _p]
    lib.ft_bridge_sim_gpu.restype = _int
    lib.ft_bridge_sim_gpu.argtypes = [_p, _p, _i64, _i64, _i64, _dbl, _p, _i64]
    lib.ft_bridge_echo.restype = _int
    lib.ft_bridge_echo.argtypes = [_p, _p, _i64, _i64, _dbl, _i64, _i64]
    lib.ft_host_bump.restype = None
    lib.ft_host_bump.argtypes = [_p]
    lib._ft_bridge_bound = True


def spin_pauses(threads: int) -> int:
    """Polls with `pause` before a spinning thread yields at every poll: a few tens of µs when
    the team and the thread that launches the graphs each have a core (the flags of a decode
    step come that fast; a yield with nobody else runnable costs well under a µs), at once
    when they do not (the thread being waited for may need this core). Measured on the dev
    box: a pure pause spin of milliseconds made a bare hand-off 3.3 ms when another process
    took a core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return 2048 if threads + 1 <= cores else 64


def native_supported(weight_dtype: torch.dtype, io_dtype: torch.dtype) -> bool:
    """Whether the step loop takes banks of `weight_dtype` and x/out of `io_dtype`."""
    return weight_dtype in _WDTYPE and io_dtype in _WDTYPE


class NativeBridge:
    """One ft_bridge: the banks' addresses and the pinned buffers, held for its lifetime."""

    def __init__(self, kern: CpuKernel, gate_up: list[Tensor], down: list[Tensor], x: Tensor,
                 ids: Tensor, mask: Tensor, out: Tensor, go: Tensor, done: Tensor,
                 threads: int) -> None:
        L, B, K, H = out.shape
        E, two_i, _ = gate_up[0].shape
        wd = gate_up[0].dtype
        if not native_supported(wd, x.dtype) or out.dtype != x.dtype:
            raise ValueError(f"unsupported dtypes: weights {wd}, x {x.dtype}, out {out.dtype}")
        for t in (*gate_up, *down):
            if t.dtype != wd or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("banks must be contiguous host tensors of one dtype")
        for t in (x, ids, mask, out, go, done):
            if not t.is_contiguous():
                raise ValueError("bridge buffers must be contiguous")
        if ids.dtype != torch.int64 or mask.dtype != torch.bool or go.dtype != torch.int64:
            raise ValueError("ids and flags must be int64, mask bool")
        self._lib = kern.lib
        _bind(self._lib)
        # the tensors stay referenced: the native side holds raw pointers into them
        self._keep = (gate_up, down, x, ids, mask, out, go, done)
        self._gu_ptrs = torch.tensor([t.data_ptr() for t in gate_up], dtype=torch.int64)
        self._dn_ptrs = torch.tensor([t.data_ptr() for t in down], dtype=torch.int64)
        self.threads = threads
        self._h = self._lib.ft_bridge_new(
            L, B, K, H, E, two_i // 2, _WDTYPE[wd], _WDTYPE[x.dtype], self._gu_ptrs.data_ptr(),
            self._dn_ptrs.data_ptr(), x.data_ptr(), ids.data_ptr(), mask.data_ptr(),
            out.data_ptr(), go.data_ptr(), done.data_ptr(), threads, spin_pauses(threads))
        self._stats = (ctypes.c_double * 6)()

    def set_cpus(self, cpus: list[int]) -> None:
        """Pin team thread t to cpus[t % len(cpus)] from the next step on ([]: no pinning)."""
        arr = (ctypes.c_int * max(1, len(cpus)))(*cpus)
        self._lib.ft_bridge_set_cpus(self._h, arr, len(cpus))

    def set_throttle(self, ns_per_expert: int) -> None:
        """Simulate a slower host from the next step on: ns_per_expert more busy time per
        expert a layer computes (benchmarks, re-profiling tests; 0: off)."""
        self._lib.ft_bridge_set_throttle(self._h, int(ns_per_expert))

    def run_step(self, seq: int, rows: int, timeout_s: float) -> StepStats:
        """Every layer of step `seq` over rows [0, rows); the GIL is released meanwhile."""
        rc = self._lib.ft_bridge_run_step(self._h, seq, rows, timeout_s, self._stats)
        s = self._stats
        if rc == 1:
            raise IndexError(f"expert id out of range in MoE layer {int(s[4])} of step {seq}")
        if rc == 3:
            raise TimeoutError(f"layer {int(s[4])} of step {seq} never arrived")
        if rc != 0:
            raise RuntimeError(f"ft_bridge_run_step failed rc={rc} (rows={rows})")
        return StepStats(s[0] * 1e-9, s[1] * 1e-9, s[2] * 1e-9, int(s[3]), int(s[5]))

    def __del__(self) -> None:
        h, self._h = getattr(self, "_h", None), None
        if h:
            self._lib.ft_bridge_free(h)


def sim_gpu(kern: CpuKernel, go: Tensor, done: Tensor, seq: int, gap_s: float,
            timeout_s: float = 10.0, team_threads: int = 1) -> list[float]:
    """The GPU's side of one step on this thread (benchmarks, tests): per layer raise go[m],
    wait for done[m] (its latency in seconds is returned), then spin `gap_s`. Releases the
    GIL; spins as politely as a team of `team_threads` would. Raises TimeoutError when a layer
    never answers."""
    _bind(kern.lib)
    L = go.numel()
    lat = (ctypes.c_double * L)()
    rc = kern.lib.ft_bridge_sim_gpu(go.data_ptr(), done.data_ptr(), L, seq, int(gap_s * 1e9),
                                    timeout_s, lat, spin_pauses(team_threads))
    if rc != 0:
        raise TimeoutError(f"a layer of step {seq} never answered")
    return [v * 1e-9 for v in lat]


def echo_step(kern: CpuKernel, go: Tensor, done: Tensor, seq: int, timeout_s: float,
              threads: int = 1, work_us: float = 0.0) -> None:
    """The host's side of a hand-off for step `seq` on this thread (the GIL released): every
    layer answered `work_us` after its go flag arrives, the host busy meanwhile (the CPU
    share's stand-in; scripts/bench_handoff.py)."""
    _bind(kern.lib)
    L = go.numel()
    rc = kern.lib.ft_bridge_echo(go.data_ptr(), done.data_ptr(), L, seq, timeout_s,
                                 spin_pauses(threads), round(work_us * 1e3))
    if rc == 3:
        raise TimeoutError(f"a go flag of step {seq} never arrived")


def host_bump_address(kern: CpuKernel) -> int:
    """Address of the C callback `ft_host_bump(void* p)`, for host-function nodes
    (cuLaunchHostFunc) in scripts/bench_handoff.py: p points at two int64 {counter, work_ns};
    the callback busy-waits work_ns, then adds one to the counter."""
    _bind(kern.lib)
    return ctypes.cast(kern.lib.ft_host_bump, ctypes.c_void_p).value
