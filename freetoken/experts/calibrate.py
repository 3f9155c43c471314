"""The first-start bandwidth measurement behind the decode equation: `measure_profile`, run
by `ft bench bw` and by the first hybrid/auto start on a GPU without a saved profile
(`measure_profile_now`, called by experts/runtime.py; `find_profile` finds a saved one).

Shape legend: P experts in the measured pool, E experts per layer window, T tokens, K top-k,
H hidden, I intermediate. S = 3 * H * I * element bytes per expert.

B_H: the real CPU kernel (freetoken.kernels.cpu.expert_ops) on *fresh* experts: each step routes
into a new window of the pool, and the pool is far larger than the LLC, so weights come from DRAM.
B_P: the real fill path: per-expert non_blocking copies from a pinned host pool into GPU slots
on a copy stream, timed with CUDA events. Both, concurrently: a Python thread runs the CPU kernel
(the GIL is released inside it) while the copy stream fills.
The measured profile is saved through `freetoken.experts.profile` (the runtime reads it). The
random pools are `make_pool`'s (below; `random_fill_` also fills `bench/random_model.py`'s
weights); helpers only benches use (`bench_banner`, `time_call`) are in
freetoken/bench/bandwidth.py.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from freetoken.experts.base import MoEHost
from freetoken.experts.cost_model import BandwidthProfile
from freetoken.experts.profile import (
    ExpertShape,
    load_profile,
    profile_key,
    save_profile,
    shape_for,
)
from freetoken.kernels.cpu.ext import load_kernel
from freetoken.kernels.quant import QuantBank, empty_bank
from freetoken.log import get_logger, kv
from freetoken.types.model_config import ExpertFormat

log = get_logger("experts")
GB = 1e9
# the short measurement a first `hybrid`/`auto` start on a GPU runs (what `ft bench bw
# --pool-gb 3 --seconds 1` does: 11.5 s on the H200 host, 2026-12-01)
AUTO_BW_SECONDS, AUTO_BW_POOL_GB = 1.0, 3.0
# the most experts a measurement pool holds: the CPU kernel's set-up is linear in its bank's
# expert count (`expert_prepare` sizes per-expert counters), so a 3 GB pool of a tiny test
# model's 6 KB FP8 experts (487k of them) made every call ~10x slower and a first hybrid start
# take minutes on the H200 host; 65,536 is ~0.3 TB of Qwen3.6 experts, so no real shape meets
# the cap, and a tiny one's capped pool (65,536 x 6 KB = 400 MB) still exceeds the H200 host's
# 300 MB L3
MAX_POOL_EXPERTS = 1 << 16


def fresh_routes(pool: int, window: int, tokens: int, top_k: int, steps: int,
                 seed: int = 0) -> list[Tensor]:
    """Per step [T, K] ids: each token picks K distinct experts of a window of `window` experts,
    and every step moves to the next window (cycling through the pool). At T=1 the picks walk a
    shuffled order of each window, so an expert is read again only after every other expert of
    its window: no step finds its weights still in the last-level cache (hundreds of MB on
    server parts) from a recent step."""
    g = torch.Generator().manual_seed(seed)
    window = min(window, pool)
    n_win = pool // window
    k = min(top_k, window)
    orders = [torch.randperm(window, generator=g) for _ in range(n_win)]
    cursor = [0] * n_win
    routes = []
    for s in range(steps):
        w = s % n_win
        base = w * window
        if tokens == 1:
            idx = (cursor[w] + torch.arange(k)) % window
            cursor[w] = (cursor[w] + k) % window
            routes.append(orders[w][idx].unsqueeze(0) + base)
        else:
            routes.append(torch.rand(tokens, window, generator=g).argsort(dim=1)[:, :k] + base)
    return routes


ExpertFn = Callable[[Tensor, Tensor, Tensor, Tensor], object]


def time_experts(fn: ExpertFn, gate_up: Tensor, down: Tensor, routes: list[Tensor],
                 warmup: int = 3, budget_s: float | None = None) -> tuple[float, float]:
    """Run fn(x, ids, gate_up, down) per route; returns (GB/s of unique expert bytes read,
    median seconds per step). Warm-up steps use the route list's tail and are not timed;
    `budget_s` stops the timed routes early once that much time is spent (at least one runs)."""
    s_bytes = gate_up[0].nbytes + down[0].nbytes  # one expert, scales included
    x = torch.randn(routes[0].shape[0], gate_up.shape[2])  # [T, H]
    for ids in routes[len(routes) - warmup:] if warmup > 0 else ():  # (routes[-0:] is all)
        fn(x, ids, gate_up, down)
    times, total_bytes, t_start = [], 0, time.perf_counter()
    for ids in routes:
        t0 = time.perf_counter()
        fn(x, ids, gate_up, down)
        times.append(time.perf_counter() - t0)
        total_bytes += int(ids.unique().numel()) * s_bytes
        if budget_s is not None and t0 - t_start > budget_s:
            break
    times.sort()
    return total_bytes / sum(times) / GB, times[len(times) // 2]


def host_read_gbps(nbytes: float, repeats: int = 5, threads: int | None = None) -> float:
    """Best of `repeats` all-thread read streams over a float32 buffer of `nbytes`, each round
    read plainly (hardware prefetch only) and with software prefetch 32 KB and 128 KB ahead."""
    buf = torch.ones(int(nbytes // 4))
    kern = load_kernel()
    best = 0.0
    for _ in range(repeats):
        for pf in (0, 32768, 131072) if kern is not None else (0,):
            t0 = time.perf_counter()
            if kern is not None:
                kern.stream_sum(buf, threads, pf)
            else:
                buf.sum()
            best = max(best, buf.numel() * 4 / (time.perf_counter() - t0) / GB)
    return best


def cpu_kernel_fn(threads: int | None = None) -> ExpertFn:
    from freetoken.kernels.cpu.expert_ops import cpu_experts

    return lambda x, ids, gu, dn: cpu_experts(x, ids, gu, dn, num_threads=threads)


def _slots_like(bank: Tensor | QuantBank, n: int) -> Tensor | QuantBank:
    """`n` GPU slots for rows of `bank` (a quantized bank's slots hold codes and scales)."""
    if isinstance(bank, QuantBank):
        return empty_bank(bank.fmt, n, bank.shape[1], bank.shape[2], bank.halves, bank.block,
                          "cuda")
    return torch.empty((n, *bank.shape[1:]), dtype=bank.dtype, device="cuda")


class FillBench:
    """Pinned host pool -> GPU slots, per-expert non_blocking copies on a copy stream (a
    quantized expert: its codes and its scales, as SlotCache.fill copies them)."""

    def __init__(self, shape: ExpertShape, dtype: torch.dtype | ExpertFormat,
                 pool_bytes: float) -> None:
        self.shape = shape
        self.gu, self.dn = make_pool(shape, dtype, pool_bytes, pin=True)  # [P, ...] pinned
        m = shape.top_k
        self.slot_gu, self.slot_dn = _slots_like(self.gu, m), _slots_like(self.dn, m)
        self.stream = torch.cuda.Stream()
        self.s_bytes = shape.expert_bytes(dtype)

    def run(self, steps: int) -> float:
        """GB/s over `steps` fills of top_k fresh experts each."""
        routes = fresh_routes(self.gu.shape[0], self.shape.experts, 1, self.shape.top_k, steps, 1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for ids in routes:
                for j, e in enumerate(ids[0].tolist()):
                    self.slot_gu[j].copy_(self.gu[e], non_blocking=True)
                    self.slot_dn[j].copy_(self.dn[e], non_blocking=True)
            end.record()
        end.synchronize()
        n = sum(int(r.numel()) for r in routes)
        return n * self.s_bytes / (start.elapsed_time(end) / 1e3) / GB

    def link_gbps(self) -> float:
        """One large pinned copy (the whole pool's gate_up codes) into one device buffer."""
        src = self.gu.data if isinstance(self.gu, QuantBank) else self.gu
        dst = torch.empty_like(src, device="cuda")
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return src.numel() * src.element_size() / (time.perf_counter() - t0) / GB


def measure_overlap(fill: FillBench, cpu_pool: tuple[Tensor, Tensor], steps: int,
                    threads: int | None) -> tuple[float, float]:
    """(B_P', B_H'): the fill loop on this thread while another thread runs the CPU kernel."""
    gu, dn = cpu_pool
    routes = fresh_routes(gu.shape[0], fill.shape.experts, 1, fill.shape.top_k, steps, 2)
    result: dict[str, float] = {}
    worker = threading.Thread(
        target=lambda: result.setdefault(
            "b_h", time_experts(cpu_kernel_fn(threads), gu, dn, routes, warmup=0)[0]))
    worker.start()
    b_p = fill.run(steps)
    worker.join()
    return b_p, result["b_h"]


def _steps_for(seconds: float, step_s: float) -> int:
    return int(min(5000, max(10, seconds / max(step_s, 1e-6))))


def measure_profile(name: str, shape: ExpertShape, dtype: torch.dtype | ExpertFormat,
                    seconds: float, pool_gb: float, threads: int, say=print) -> BandwidthProfile:
    """Measure the machine's profile for an expert shape (keyed `name`) in a bank format
    (`dtype`: dense, or an `ExpertFormat`, whose pools hold quantized banks: B_H is then the
    quantized CPU kernel, B_P the codes + scales copies, and every rate counts the real
    bytes, `expert_nbytes`): the host read ceiling, B_H (the CPU kernel at batch 1 on fresh
    experts), and with CUDA the link ceiling, B_P and the pair at once. `say` gets one line
    per stage (progress)."""
    s_bytes = shape.expert_bytes(dtype)
    pool = pool_gb * 1e9
    say(f"[bw] shape={name} dtype={profile_key(name, dtype)['dtype'].removeprefix('torch.')} "
        f"expert={s_bytes / 1e6:.2f} MB pool={pool_gb:g} GB threads={threads}")

    say("[bw] host read ceiling ...")
    host_read = host_read_gbps(min(pool, 4e9),  # the machine's: every thread
                                   threads=max(threads, torch.get_num_threads()))

    say("[bw] B_H: CPU kernel, batch 1, fresh experts ...")
    cpu_pool = make_pool(shape, dtype, pool)
    fn = cpu_kernel_fn(threads)
    n_pool = cpu_pool[0].shape[0]
    # one untimed pass over the whole pool first (a fresh pool's first reads ran slower on the
    # H200 host), then the median of three windows: the host's bandwidth drifts with its
    # other tenants, and B_H steers `auto` and every floor. The pass stops after `seconds`
    # (a small expert shape's pool is MAX_POOL_EXPERTS kernel calls of tiny experts)
    warm = fresh_routes(n_pool, shape.experts, 1, shape.top_k, n_pool // shape.top_k + 1, 7)
    _, step_s = time_experts(fn, *cpu_pool, warm, warmup=0, budget_s=seconds)
    steps = _steps_for(seconds, step_s)
    windows = sorted(
        time_experts(fn, *cpu_pool, fresh_routes(n_pool, shape.experts, 1, shape.top_k,
                                                       max(3, steps // 3), w))[0]
        for w in range(3))
    b_h = windows[1]
    say(f"[bw] B_H windows: {', '.join(f'{v:.1f}' for v in windows)} GB/s (median kept)")

    b_p = link = b_p_o = b_h_o = None
    if torch.cuda.is_available():
        say("[bw] B_P: pinned pool -> GPU slots ...")
        fill = FillBench(shape, dtype, pool)
        link = fill.link_gbps()
        fill.run(3)
        b_p = fill.run(_steps_for(seconds, shape.top_k * s_bytes / (b_p or 30e9)))
        say("[bw] B_P' and B_H' concurrently ...")
        b_p_o, b_h_o = measure_overlap(fill, cpu_pool, steps, threads)
        del fill
    else:
        say("[bw] no CUDA device: B_P skipped (the profile holds B_H only)")
    return BandwidthProfile(
        key=profile_key(name, dtype), b_h=b_h, b_p=b_p, b_p_overlap=b_p_o,
        b_h_overlap=b_h_o, host_read=host_read, link=link, expert_bytes=s_bytes,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), cpu_threads=threads,
    )


def find_profile(host: MoEHost, dtype: torch.dtype | ExpertFormat) -> BandwidthProfile | None:
    return load_profile(profile_key(shape_for(host.cfg)[0], dtype))


def measure_profile_now(host: MoEHost, dtype: torch.dtype | ExpertFormat, threads: int
                        ) -> BandwidthProfile | None:
    """Measure and save this machine's bandwidth profile for the model's expert shape (a
    first start without one), logging each stage; None, with a warning, if it fails."""
    name, shape = shape_for(host.cfg)
    log.info(kv("bw_profile_measure", shape=name, fmt=profile_key(name, dtype)["dtype"],
                threads=threads, pool_gb=AUTO_BW_POOL_GB,
                why="no profile for this machine and shape (once; --no-bw-measure skips)"))
    t0 = time.perf_counter()
    try:
        prof = measure_profile(name, shape, dtype, AUTO_BW_SECONDS, AUTO_BW_POOL_GB, threads,
                               say=lambda line: log.info(kv("bw_profile_stage", stage=line)))
    except (RuntimeError, OSError, ValueError) as e:  # e.g. no pinned memory to spare
        log.warning(kv("bw_profile_measure_failed", error=f"{type(e).__name__}: {e}"))
        return None
    save_profile(prof)
    log.info(kv("bw_profile_measured", seconds=f"{time.perf_counter() - t0:.1f}",
                b_p=f"{prof.b_p or 0:.1f}", b_h=f"{prof.b_h:.1f}",
                b_p_overlap=f"{prof.b_p_overlap or 0:.1f}",
                b_h_overlap=f"{prof.b_h_overlap or 0:.1f}"))
    return prof


# -- random expert banks (benchmark-sized pools, tens of GB) --------------------------------------
# `torch.normal_` on a bf16 CPU tensor runs at well under 100 MB/s, so a 32 GB pool would take
# minutes of device time. Benchmarks only need non-zero, non-degenerate data with the right
# scale: draw one random block once and copy shifted windows of it (copies run at memory
# bandwidth), so neighbouring experts differ.
_BLOCK = 1 << 24  # 16 M elements


def random_fill_(t: torch.Tensor, std: float, seed: int = 0) -> torch.Tensor:
    """Fill `t` (any float dtype, any device) with N(0, std)-distributed windows; returns t."""
    g = torch.Generator().manual_seed(seed)
    block = (torch.randn(_BLOCK + 4096, generator=g) * std).to(t.dtype).to(t.device)
    flat = t.view(-1)
    n, step, i = flat.numel(), _BLOCK, 0
    while i < n:
        k = min(step, n - i)
        off = (i // step * 977) % 4096  # shift the window so repeated blocks are not aligned
        flat[i:i + k].copy_(block[off:off + k])
        i += k
    return t


def make_pool(shape: ExpertShape, dtype: torch.dtype | ExpertFormat, pool_bytes: float,
              pin: bool = False) -> tuple[Tensor | QuantBank, Tensor | QuantBank]:
    """Random expert banks holding about `pool_bytes` (at most MAX_POOL_EXPERTS experts):
    gate_up [P, 2I, H], down [P, H, I];
    QuantBanks for a quantized format (a few random experts quantized, repeated)."""
    p = max(1, min(MAX_POOL_EXPERTS, int(pool_bytes // shape.expert_bytes(dtype))))
    h, i = shape.hidden, shape.inter
    if isinstance(dtype, ExpertFormat):
        from freetoken.kernels.quant import quantize_bank

        g = torch.Generator().manual_seed(1)
        n = min(p, 4)
        banks = []
        for rows, cols, halves in ((2 * i, h, 2), (h, i, 1)):
            seed = quantize_bank(torch.randn(n, rows, cols, generator=g) * cols**-0.5,
                                 dtype.name, dtype.block, halves)
            idx = torch.arange(p) % n  # [P] which seed expert each pool expert copies
            bank = seed.index_select(0, idx)
            banks.append(bank.pin_memory() if pin else bank)
        return banks[0], banks[1]
    # random data, never zeros (zeros can run faster); filled first, pinned afterwards
    gate_up = random_fill_(torch.empty(p, 2 * i, h, dtype=dtype), h**-0.5, 1)  # [P, 2I, H]
    down = random_fill_(torch.empty(p, h, i, dtype=dtype), i**-0.5, 2)  # [P, H, I]
    if pin:
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    return gate_up, down
