"""The expert runtime: one object per served model that owns everything about its routed experts.

`MoERuntime.build(host, config, device)` moves every routed expert bank into the host
`ExpertStore`, sizes and builds the shared `SlotCache` on the compute device, picks the backend
(`auto`: from the bandwidth profile), builds the prefill streamer and `auto`'s guard, and
installs one complete backend (experts/registry.py) on every MoE block — once. The caller then
moves the rest of the model to the device. After that the engine talks to the runtime only:

- `step(kind, tokens)`: a context around one forward step the engine runs eagerly; it marks
  the step for `auto`'s guard and yields the step's `MoEStep` (`streamed` when the layer
  streamer takes the chunk, else `eager`), which the batch carries to every backend;
- `bridge_for(max_batch)` and `capturable(bridge)`: what the decode runner needs to capture
  its steps (the runner passes its bridge in its own `captured` MoEStep);
- `resize(...)`: re-budget the slot cache between steps; `stats()`: the counters for
  /v1/stats; `settled`: whether steps may overlap (auto has finished timing).

Shapes: L MoE layers, E experts per layer, S slots.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from freetoken.experts.auto import AutoGuard
from freetoken.experts.base import MoEHost
from freetoken.experts.bridge import CpuBridge
from freetoken.experts.cost_model import BandwidthProfile, recommend_backend
from freetoken.experts.fused import FusedExperts
from freetoken.experts.profile import load_profile, profile_key, save_profile, shape_for
from freetoken.experts.registry import create_backend
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.split import (
    CpuSplitExperts,
    FetchRule,
    FixedRule,
    QStarRule,
    cpu_branch,
)
from freetoken.experts.stats import MoEStats
from freetoken.experts.store import ExpertStore
from freetoken.experts.streamer import LayerStreamer, StreamCosts, stream_threshold
from freetoken.log import get_logger, kv
from freetoken.types.api import AdmissionError
from freetoken.types.config import WORKSPACE_MARGIN_BYTES, MoEConfig
from freetoken.types.forward_batch import EAGER, MoEStep
from freetoken.types.model_config import ExpertFormat
from kernels.quant import QuantBank

log = get_logger("experts")
# DESIGN §9 figures, used only when no profile was measured on this machine
_FALLBACK_BP, _FALLBACK_BH = 48.5, 88.0
# the short measurement a first `hybrid`/`auto` start on a GPU runs (what `ft bench bw
# --pool-gb 3 --seconds 1` does: 11.5 s on the H200 host, 2026-12-01)
AUTO_BW_SECONDS, AUTO_BW_POOL_GB = 1.0, 3.0


class ResizeError(RuntimeError):
    """A run-time re-budget could not allocate; the previous cache is still serving."""


class MoERuntime:
    """See the module docstring. Built by `build`; its parts are read by `create_backend`."""

    def __init__(self, backend: str, cache: SlotCache | None, store: ExpertStore | None,
                 counters: MoEStats | None = None, *, top_k: int = 1,
                 cpu_threads: int | None = None, q_rule: FetchRule | None = None,
                 guard: AutoGuard | None = None, streamer: LayerStreamer | None = None,
                 cpu_layers: int = 0, device: torch.device | str = "cpu"):
        self.backend, self.cache, self.store = backend, cache, store
        self.counters = counters if counters is not None else MoEStats(
            store.expert_bytes if store is not None else 0)
        self.top_k, self.cpu_threads, self.q_rule = top_k, cpu_threads, q_rule
        self.guard, self.streamer, self.cpu_layers = guard, streamer, cpu_layers
        self.device = torch.device(device)
        self.backends: list = []  # one per MoE layer, once installed
        self._bridges: list[CpuBridge] = []

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def build(cls, host: MoEHost, config: MoEConfig, device: torch.device | str,
              kv_reserve_bytes: int = 0, profile: BandwidthProfile | None = None,
              store: ExpertStore | None = None) -> MoERuntime:
        """The runtime of `config.backend` for `host`, installed on it. The banks come from
        the blocks' resident `FusedExperts`, or from `store` when given (benchmarks switch
        backends over one store)."""
        device = torch.device(device)
        cfg = host.cfg
        if config.backend == "fused":
            rt = cls("fused", None, store, top_k=cfg.top_k, device=device)
            if store is not None:  # every bank of the store onto the device
                rt.install(host)
            return rt
        blocks = host.moe_blocks()
        if store is None:
            store = ExpertStore([_bank(b.experts.gate_up_proj) for b in blocks],
                                [_bank(b.experts.down_proj) for b in blocks],
                                pin=device.type == "cuda", compute_dtype=_dense_dtype(host))
        pool = store.num_layers * store.num_experts
        # the rest of the model moves to the device after this: keep room for it too
        others = sum(p.numel() * p.element_size() for n, p in host.named_parameters()
                     if ".experts." not in n)
        slots = _num_slots(config, pool, store.expert_bytes, device, kv_reserve_bytes + others)
        log.info(kv("vram_plan", slots=slots, slot_mb=store.expert_bytes * slots // 2**20,
                    kv_reserve_mb=kv_reserve_bytes // 2**20, other_weights_mb=others // 2**20))
        cache = SlotCache(store.num_layers, store.num_experts, store.hidden, store.intermediate,
                          slots, dtype=store.dtype, device=device,
                          impl="triton" if device.type == "cuda" else "reference", fmt=store.fmt)
        backend = config.backend
        cpu_threads = config.cpu_threads or default_cpu_threads(device)
        if profile is None and backend in ("auto", "hybrid"):
            # a quantized store without its own profile prices its bytes at the dense one's
            profile = find_profile(host, store.format) or (
                find_profile(host, store.dtype) if store.fmt is not None else None)
            if (profile is None and device.type == "cuda" and config.measure_bw
                    and store.fmt is None):  # `ft bench bw` measures dense pools only
                profile = measure_profile_now(host, store.dtype, cpu_threads)
        q_rule = _q_rule(profile, config.hybrid_max_fetch)
        guard = None
        if backend == "auto" and slots >= pool:
            # every expert fits: nothing is left to split or to time, and a guard would make
            # offload take the CPU bridge it never needs (a cold-start crash: issue #20)
            backend = "offload"
            log.info(kv("auto_choice", backend=backend, cache_rate="1.000",
                        why="every_expert_fits"))
        elif backend == "auto":
            choice = recommend_backend(profile, slots / pool, cfg.top_k) if profile else "offload"
            log.info(kv("auto_choice", backend=choice, cache_rate=f"{slots / pool:.3f}",
                        profile="measured" if profile else "none"))
            rule = {"offload": FixedRule(-1), "cpu": FixedRule(0)}.get(choice, q_rule)
            guard = AutoGuard(choice, rule)
        if backend == "hybrid" and profile is None:
            log.warning(kv("no_bw_profile", using=f"B_P={_FALLBACK_BP} B_H={_FALLBACK_BH}",
                           hint="run `ft bench bw`"))
        if (profile is not None and profile.cpu_threads and backend in ("hybrid", "cpu")
                and cpu_threads != profile.cpu_threads):
            # B_H scales with the threads behind it: q* and the floors lean on the profile's
            log.warning(kv("bw_profile_threads_differ", profile_threads=profile.cpu_threads,
                           cpu_threads=cpu_threads,
                           hint=f"run `ft bench bw --threads {cpu_threads}`"))
        counters = MoEStats(store.expert_bytes)
        streamer = make_streamer(config, guard.choice if guard else backend, cache, store,
                                 counters, profile, cfg.top_k)
        rt = cls(backend, cache, store, counters, top_k=cfg.top_k, cpu_threads=cpu_threads,
                 q_rule=q_rule, guard=guard, streamer=streamer, cpu_layers=config.cpu_layers,
                 device=device)
        rt.install(host)
        if backend == "cpu":
            _prefill_static(cache, store, slots)
        log.info(kv("moe_backend", backend=backend, slots=slots, pool=pool,
                    rate=f"{slots / pool:.3f}", slot_mb=store.expert_bytes * slots // 2**20,
                    device=device, cpu_layers=config.cpu_layers, cpu_threads=cpu_threads))
        return rt

    def install(self, host: MoEHost) -> None:
        """Give every MoE block of `host` its backend (once per runtime)."""
        if self.backends:
            raise RuntimeError("this expert runtime is installed already")
        blocks = host.moe_blocks()
        for i, b in enumerate(blocks):
            on_cpu = i >= len(blocks) - self.cpu_layers
            b.experts = create_backend("cpu" if on_cpu else self.backend, i, self)
            self.backends.append(b.experts)

    def uninstall(self, host: MoEHost) -> None:
        """Give every MoE block an empty `fused` bank back (a benchmark frees this runtime's
        device copies before installing the next)."""
        for b in host.moe_blocks():
            b.experts = FusedExperts(1, 1, 1)
        self.backends = []

    def fused_banks(self, layer: int) -> tuple[Tensor, Tensor]:
        """`fused` over a store: layer `layer`'s banks copied to the device."""
        assert self.store is not None
        return self.store.gate_up(layer).to(self.device), self.store.down(layer).to(self.device)

    # -- what the engine asks -------------------------------------------------------------------

    @contextmanager
    def step(self, kind: str, tokens: int = 1) -> Iterator[MoEStep]:
        """One eager forward step of `tokens` tokens; `kind` "decode" when every row of the
        step is one token of a decoding sequence (however many sequences), else "prefill".
        Marks the step for `auto`'s guard (it times decode steps, from here to the end of the
        block, where the step's tokens are on the host) and lends the streamer the chunk when
        it takes it."""
        if self.guard is not None:
            self.guard.on_step(kind == "decode")
        streamed = self.streamer is not None and self.streamer.begin_forward(tokens)
        try:
            yield MoEStep("streamed") if streamed else EAGER
        finally:
            if streamed:
                self.streamer.end_forward()
        if self.guard is not None:
            self.guard.end_step()

    @property
    def settled(self) -> bool:
        """Whether steps may overlap: always, except while `auto`'s guard times its phases."""
        return self.guard is None or self.guard.settled

    def bridge_for(self, max_batch: int) -> CpuBridge | None:
        """A CpuBridge for a decode runner of up to `max_batch` rows when some MoE layer can
        send work to the CPU in its steps (hybrid, cpu, auto, offload with fewer slots than a
        step can route); None when none can. The runner hands it to its steps (MoEStep)."""
        k = self.top_k
        layers = [e for e in self.backends
                  if isinstance(e, CpuSplitExperts) and e.needs_bridge(max_batch * k)]
        if not layers or self.store is None:
            return None
        store, threads, L = self.store, self.cpu_threads, self.store.num_layers
        banks = ([store.gate_up(m) for m in range(L)], [store.down(m) for m in range(L)])
        bridge = CpuBridge(L, max_batch, k, store.hidden, store.dtype, self.device,
                           lambda m, x, ids, mask: cpu_branch(x, ids, mask, store, m, threads),
                           banks=banks, threads=threads)
        self._bridges.append(bridge)
        log.info(kv("cpu_bridge", layers=len(layers), rows=max_batch, threads=threads,
                    loop="native" if bridge.native is not None else "python"))
        return bridge

    def drop_bridge(self, bridge: CpuBridge) -> None:
        """Stop a bridge the engine no longer uses (its worker failed)."""
        bridge.close()
        if bridge in self._bridges:
            self._bridges.remove(bridge)

    def capturable(self, bridge: CpuBridge | None) -> bool:
        """Whether every MoE layer decodes without host syncs given `bridge`: offload fills
        from the device, the CPU-branch backends (and `auto`, whichever rule its guard runs)
        hand off through the bridge."""
        return all(b.device_fill or bridge is not None for b in self.backends)

    @property
    def generation(self) -> int:
        """Changes whenever the slot cache's buffers are replaced (captured graphs go)."""
        return self.cache.generation if self.cache is not None else 0

    def resize(self, slots: int | None = None, rate: float | None = None,
               mem: int | None = None) -> dict:
        """Re-budget the slot cache (between steps). All or nothing: a failed allocation
        leaves the old cache serving and raises `ResizeError`."""
        if self.cache is None or self.store is None:
            raise AdmissionError("this server runs without an expert slot cache "
                                 "(--moe-backend fused); nothing to re-budget", "slots")
        pool = self.store.num_layers * self.store.num_experts
        given = [v for v in (slots, rate, mem) if v is not None]
        if len(given) != 1:
            raise AdmissionError("give exactly one of slots, rate, mem", "slots")
        if rate is not None:
            n = round(rate * pool) if 0 < rate <= 1 else -1
        elif mem is not None:
            n = min(pool, mem // self.store.expert_bytes) if mem > 0 else -1  # a budget: clamp
        else:
            n = slots if isinstance(slots, int) else -1
        if not 1 <= n <= pool:
            raise AdmissionError(f"the cache must hold between 1 and {pool} slots (got {n})",
                                 "slots")
        old = self.cache.num_slots
        try:
            self.cache.resize(n)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            log.warning(kv("experts_resize_failed", old=old, asked=n, error=type(e).__name__))
            raise ResizeError(f"could not allocate {n} slots ({e}); still serving with {old}")
        log.info(kv("experts_resized", old=old, new=n, pool=pool))
        return {"slots": n, "previous": old, "pool": pool, "rate": round(n / pool, 4),
                "resident": self.cache.table.resident_count(),
                "slot_bytes": self.store.expert_bytes}

    def stats(self) -> dict | None:
        """The expert counters for /v1/stats (None without a slot cache)."""
        if self.cache is None:
            return None
        return {"backend": self.backend, "slots": self.cache.num_slots,
                **self.counters.as_dict()}


def _bank(p: Tensor | QuantBank) -> Tensor | QuantBank:
    """A block's bank as the store takes it (a parameter's data, a quantized bank as is)."""
    return p if isinstance(p, QuantBank) else p.data


def _dense_dtype(host: MoEHost) -> torch.dtype:
    """The model's activation dtype (its first non-expert parameter's)."""
    return next((p.dtype for n, p in host.named_parameters() if ".experts." not in n),
                torch.float32)


def _q_rule(profile: BandwidthProfile | None, max_fetch: int | None) -> QStarRule:
    overlap = bool(profile and profile.has_overlap)
    b_p = (profile.b_p_overlap if overlap else
           profile.b_p if profile and profile.b_p else _FALLBACK_BP)
    b_h = (profile.b_h_overlap if overlap else profile.b_h if profile else _FALLBACK_BH)
    return QStarRule(b_p, b_h, overlap, max_fetch)


def _num_slots(config: MoEConfig, pool: int, expert_bytes: int, device: torch.device,
               kv_reserve_bytes: int) -> int:
    if config.cache_size is not None:
        s = config.cache_size
    elif config.cache_rate is not None:
        s = round(config.cache_rate * pool)
    elif config.cache_mem is not None:
        s = config.cache_mem // expert_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        s = (free - kv_reserve_bytes - WORKSPACE_MARGIN_BYTES) // expert_bytes
    else:
        s = pool // 4
    return max(1, min(int(s), pool))


def find_profile(host: MoEHost, dtype: torch.dtype | ExpertFormat) -> BandwidthProfile | None:
    return load_profile(profile_key(shape_for(host.cfg)[0], dtype))


def measure_profile_now(host: MoEHost, dtype: torch.dtype, threads: int
                        ) -> BandwidthProfile | None:
    """Measure and save this machine's bandwidth profile for the model's expert shape (a
    first start without one), logging each stage; None, with a warning, if it fails."""
    from freetoken.experts.bandwidth import measure_profile

    name, shape = shape_for(host.cfg)
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


def make_streamer(config: MoEConfig, backend: str, cache: SlotCache, store: ExpertStore,
                  stats: MoEStats, profile: BandwidthProfile | None, top_k: int
                  ) -> LayerStreamer:
    """The prefill layer streamer, its token threshold from the profile (or the option)."""
    threshold = config.prefill_stream_tokens
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
    log.info(kv("prefill_stream_plan", mode=config.prefill_stream, threshold=threshold, how=how,
                backend=backend, overlap=config.prefill_overlap,
                hit_d2d=config.prefill_hit_d2d))
    return LayerStreamer(cache, store, stats, threshold, mode=config.prefill_stream,
                         overlap=config.prefill_overlap, hits_in_place=config.prefill_hit_d2d,
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
