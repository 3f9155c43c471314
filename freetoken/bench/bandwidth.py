"""Timing helpers only benchmarks use (the CPU kernel scripts, `ft bench`): `time_call` and
`bench_banner`. The first-start measurement itself is freetoken/experts/calibrate.py."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from freetoken.experts.calibrate import host_read_gbps
from freetoken.kernels.cpu.ext import load_kernel


def time_call(fn: Callable[[], object], seconds: float, warmup: int = 2) -> float:
    """Mean seconds per call of fn over about `seconds`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n == 0:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def bench_banner(what: str = "") -> tuple[int, float]:
    """Print the CPU, the kernel build and torch's thread count, then measure and print the
    all-thread host read ceiling; returns (threads, ceiling GB/s). For the CPU kernel scripts."""
    from freetoken.kernels.cpu.ext import cpu_model

    kern = load_kernel()
    nth = torch.get_num_threads()
    print(f"[bench] cpu={cpu_model()!r} isa={kern.built_isa if kern else 'torch-only'} "
          f"threads={nth}{' ' + what if what else ''}", flush=True)
    ceiling = host_read_gbps(1e9, repeats=3, threads=nth)
    print(f"ceiling (all-thread read stream): {ceiling:.1f} GB/s", flush=True)
    return nth, ceiling
