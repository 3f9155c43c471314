"""Turn a loaded model (on the CPU) into one running the chosen expert backend.

`configure_experts` moves every routed expert bank into the host `ExpertStore`, builds the
shared `SlotCache` on the compute device, and swaps each MoE block's `experts` for a view of
that cache. The caller then moves the rest of the model to the device.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from freetoken.experts.backends import AutoGuard, MoEStats
from freetoken.experts.cost_model import (
    BandwidthProfile,
    q_star,
    q_star_overlapped,
    recommend_backend,
)
from freetoken.experts.profile import load_profile, profile_key, save_profile, shape_for
from freetoken.experts.registry import create_backend
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.store import ExpertStore
from freetoken.experts.streamer import LayerStreamer, StreamCosts, stream_threshold
from freetoken.log import get_logger, kv

if TYPE_CHECKING:
    from freetoken.models.qwen import QwenMoE

log = get_logger("experts")
BACKENDS = ("auto", "fused", "offload", "cpu", "hybrid")
# DESIGN §9 figures, used only when no profile was measured on this machine
_FALLBACK_BP, _FALLBACK_BH = 48.5, 88.0
# device memory kept free for activations and workspaces when the slot cache and the KV pool
# are sized from what is free
WORKSPACE_MARGIN_BYTES = 1 << 30


@dataclass
class MoEOptions:
    backend: str = "fused"
    cache_size: int | None = None  # slots
    cache_rate: float | None = None  # fraction of the pool
    cache_mem: int | None = None  # bytes
    kv_reserve_tokens: int = 8192
    cpu_layers: int = 0  # the last N MoE layers always run on the CPU
    hybrid_max_fetch: int | None = None
    cpu_threads: int | None = None  # CPU branch threads (None: default_cpu_threads)
    prefill_stream: str = "auto"  # auto | on | off (experts/streamer.py)
    prefill_stream_tokens: int | None = None  # the threshold (None: from the profile)
    prefill_overlap: bool = True  # two buffers (off: one, copy and compute serialised)
    prefill_hit_d2d: bool = True  # resident experts stay off the link (read in place)
    # hybrid/auto on a GPU with no saved bandwidth profile: measure one at start (once)
    measure_bw: bool = True

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("--moe-cpu-threads must be at least 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"--moe-backend must be one of {', '.join(BACKENDS)}")
        if self.cache_rate is not None and not 0 < self.cache_rate <= 1:
            raise ValueError("--moe-cache-rate must be in (0, 1]")
        if self.prefill_stream not in ("auto", "on", "off"):
            raise ValueError("--moe-prefill-stream must be one of auto, on, off")
        if self.prefill_stream_tokens is not None and self.prefill_stream_tokens < 2:
            raise ValueError("--moe-prefill-stream-tokens must be at least 2")


@dataclass
class MoERuntime:
    backend: str
    cache: SlotCache | None
    store: ExpertStore | None
    stats: MoEStats
    guard: AutoGuard | None = None
    streamer: LayerStreamer | None = None


def _num_slots(opts: MoEOptions, pool: int, expert_bytes: int, device: torch.device,
               kv_reserve_bytes: int) -> int:
    if opts.cache_size is not None:
        s = opts.cache_size
    elif opts.cache_rate is not None:
        s = round(opts.cache_rate * pool)
    elif opts.cache_mem is not None:
        s = opts.cache_mem // expert_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        s = (free - kv_reserve_bytes - WORKSPACE_MARGIN_BYTES) // expert_bytes
    else:
        s = pool // 4
    return max(1, min(int(s), pool))


def find_profile(model: QwenMoE, dtype: torch.dtype) -> BandwidthProfile | None:
    return load_profile(profile_key(shape_for(model.cfg)[0], dtype))


# the short measurement a first `hybrid`/`auto` start on a GPU runs (what `ft bench bw
# --pool-gb 3 --seconds 1` does: 11.5 s on the H200 host, 2026-12-01)
AUTO_BW_SECONDS, AUTO_BW_POOL_GB = 1.0, 3.0


def measure_profile_now(model: QwenMoE, dtype: torch.dtype, threads: int
                        ) -> BandwidthProfile | None:
    """Measure and save this machine's bandwidth profile for the model's expert shape (a
    first start without one), logging each stage; None, with a warning, if it fails."""
    from freetoken.experts.bandwidth import measure_profile

    name, shape = shape_for(model.cfg)
    log.info(kv("bw_profile_measure", shape=name, threads=threads, pool_gb=AUTO_BW_POOL_GB,
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


def configure_experts(model: QwenMoE, opts: MoEOptions, device: torch.device | str,
                      kv_reserve_bytes: int = 0, profile: BandwidthProfile | None = None,
                      store: ExpertStore | None = None) -> MoERuntime:
    """Install `opts.backend` on every MoE block. The banks come from the blocks' resident
    `FusedExperts`, or from `store` when given (benchmarks switch backends over one store)."""
    device = torch.device(device)
    stats = MoEStats()
    if opts.backend == "fused":
        model.forward_hooks = []
        return MoERuntime("fused", None, store, stats)
    blocks = model.moe_blocks()
    cfg = model.cfg
    if store is None:
        store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                            [b.experts.down_proj.data for b in blocks], pin=device.type == "cuda")
    stats.expert_bytes = store.expert_bytes
    pool = store.num_layers * store.num_experts
    # the rest of the model moves to the device after this: keep room for it too
    others = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if ".experts." not in n)
    slots = _num_slots(opts, pool, store.expert_bytes, device, kv_reserve_bytes + others)
    log.info(kv("vram_plan", slots=slots, slot_mb=store.expert_bytes * slots // 2**20,
                kv_reserve_mb=kv_reserve_bytes // 2**20, other_weights_mb=others // 2**20))
    cache = SlotCache(store.num_layers, store.num_experts, store.hidden, store.intermediate, slots,
                      dtype=store.dtype, device=device,
                      impl="triton" if device.type == "cuda" else "reference")
    backend, guard = opts.backend, None
    cpu_threads = opts.cpu_threads or default_cpu_threads(device)
    if profile is None and backend in ("auto", "hybrid"):
        profile = find_profile(model, store.dtype)
        if profile is None and device.type == "cuda" and opts.measure_bw:
            profile = measure_profile_now(model, store.dtype, cpu_threads)
    if backend == "auto":
        rate = slots / pool
        backend = recommend_backend(profile, rate, cfg.top_k) if profile else "offload"
        log.info(kv("auto_choice", backend=backend, cache_rate=f"{rate:.3f}",
                    profile="measured" if profile else "none"))
    overlap = bool(profile and profile.has_overlap)
    b_p = (profile.b_p_overlap if overlap else
           profile.b_p if profile and profile.b_p else _FALLBACK_BP)
    b_h = (profile.b_h_overlap if overlap else profile.b_h if profile else _FALLBACK_BH)
    if backend == "hybrid" and profile is None:
        log.warning(kv("no_bw_profile", using=f"B_P={_FALLBACK_BP} B_H={_FALLBACK_BH}",
                       hint="run `ft bench bw`"))

    def q_for(kind: str):
        if kind == "offload":
            return lambda m: -1
        if kind == "cpu":
            return lambda m: 0
        if overlap:  # the measured concurrent pair: q* = m·B_P'/(B_P' + B_H')
            return lambda m: q_star_overlapped(m, b_p, b_h, opts.hybrid_max_fetch)
        return lambda m: q_star(m, b_p, b_h, opts.hybrid_max_fetch)

    if opts.backend == "auto":
        guard = AutoGuard(backend, q_for(backend))
    if (profile is not None and profile.cpu_threads and backend in ("hybrid", "cpu")
            and cpu_threads != profile.cpu_threads):
        # B_H scales with the threads behind it: q* and the floors lean on the profile's
        log.warning(kv("bw_profile_threads_differ", profile_threads=profile.cpu_threads,
                       cpu_threads=cpu_threads,
                       hint=f"run `ft bench bw --threads {cpu_threads}`"))
    for i, b in enumerate(blocks):
        on_cpu = i >= len(blocks) - opts.cpu_layers
        nf = (lambda m: 0) if on_cpu else (guard.num_fetch if guard else q_for(backend))
        # `auto` follows its guard's rule (its choice, then offload while timing it)
        fixed = (0 if on_cpu or (backend == "cpu" and not guard)
                 else -1 if backend == "offload" and not guard else None)
        b.experts = create_backend(backend, i, cache=cache, store=store, stats=stats,
                                   num_fetch=nf, fixed_fetch=fixed, cpu_threads=cpu_threads,
                                   guard=guard)
    if backend == "cpu":
        _prefill_static(cache, store, slots)
    log.info(kv("moe_backend", backend=backend, slots=slots, pool=pool,
                rate=f"{slots / pool:.3f}", slot_mb=store.expert_bytes * slots // 2**20,
                device=device, cpu_layers=opts.cpu_layers, cpu_threads=cpu_threads))
    streamer = make_streamer(opts, backend, cache, store, stats, profile, cfg.top_k)
    for b in blocks:
        b.experts.streamer = streamer
    model.forward_hooks = [streamer]
    return MoERuntime(backend, cache, store, stats, guard, streamer)


def make_streamer(opts: MoEOptions, backend: str, cache: SlotCache, store: ExpertStore,
                  stats: MoEStats, profile: BandwidthProfile | None, top_k: int
                  ) -> LayerStreamer:
    """The prefill layer streamer, its token threshold from the profile (or the option)."""
    threshold = opts.prefill_stream_tokens
    how = "option"
    if threshold is None:
        b_p = (profile.b_p if profile and profile.b_p else _FALLBACK_BP) * 1e9
        b_h = (profile.b_h if profile else _FALLBACK_BH) * 1e9
        costs = StreamCosts(backend, store.num_experts, top_k, store.expert_bytes,
                            6.0 * store.hidden * store.intermediate,
                            min(1.0, cache.num_slots / (store.num_layers * store.num_experts)),
                            b_p, b_h)
        threshold = stream_threshold(costs)
        how = "measured_profile" if profile else "fallback_bandwidths"
    log.info(kv("prefill_stream_plan", mode=opts.prefill_stream, threshold=threshold, how=how,
                backend=backend, overlap=opts.prefill_overlap, hit_d2d=opts.prefill_hit_d2d))
    return LayerStreamer(cache, store, stats, threshold, mode=opts.prefill_stream,
                         overlap=opts.prefill_overlap, hits_in_place=opts.prefill_hit_d2d,
                         seed=backend != "cpu")


def default_cpu_threads(device: torch.device | str) -> int:
    """Threads for the CPU expert branch: torch's thread count (OMP_NUM_THREADS, else the
    cores), and with a GPU at most every core this process may run on less one, since the main
    thread drives the GPU meanwhile. The branch is one parallel call per layer that lasts as
    long as its slowest thread, so a kernel thread sharing a core with the thread that launches
    GPU work and fills slots (hybrid runs both at once) can hold up the whole call (inferred
    from the H200 decode profile, where hybrid ran at 17 tok/s beside offload's 43; the new
    default is not re-measured there yet)."""
    n = torch.get_num_threads()
    if torch.device(device).type == "cuda":
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        n = min(n, cores - 1)
    return max(1, n)


def _prefill_static(cache: SlotCache, store: ExpertStore, slots: int) -> None:
    """`cpu` backend: fill the cache once with whole layers in order (a static split)."""
    E = store.num_experts
    for m in range(store.num_layers):
        n = min(E, slots - m * E)
        if n <= 0:
            break
        ids = torch.arange(n).view(1, n)
        d = cache.decide(m, ids, -1)
        cache.fill(m, d.fetch_experts, d.fetch_slots, store)
