"""The expert runtime: one object per served model that owns everything about its routed experts.

`MoERuntime.build(host, config, device)` moves every routed expert bank into the host
`ExpertStore`, sizes and builds the shared `SlotCache` on the compute device, picks the backend
(`auto`: from the bandwidth profile), builds the prefill streamer and `auto`'s guard (which
times every candidate backend on the live decode steps and settles on the fastest), and
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

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from freetoken.experts.auto import AutoGuard, candidate_rules
from freetoken.experts.base import MoEHost
from freetoken.experts.bridge import CpuBridge
from freetoken.experts.bw_track import (
    DRIFT,
    REPROFILE_EVERY_STEPS,
    Reprofiler,
    native_sampler,
    timed_branch,
)
from freetoken.experts.calibrate import find_profile, measure_profile_now
from freetoken.experts.cost_model import BandwidthProfile, recommend_backend
from freetoken.experts.fused import FusedExperts
from freetoken.experts.registry import create_backend
from freetoken.experts.runtime_setup import (
    FALLBACK_BH,
    FALLBACK_BP,
    default_cpu_threads,
    follow_guard,
    make_streamer,
    prefill_static,
    q_rule_for,
    slot_count,
)
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.split import (
    CpuSplitExperts,
    FetchRule,
    QStarRule,
    cpu_branch,
)
from freetoken.experts.stats import MoEStats
from freetoken.experts.store import ExpertStore
from freetoken.experts.streamer import LayerStreamer
from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.quant import QuantBank
from freetoken.log import get_logger, kv
from freetoken.types.api import AdmissionError
from freetoken.types.config import MoEConfig
from freetoken.types.forward_batch import EAGER, MoEStep

log = get_logger("experts")


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
        # per MoE layer: a host copy of its experts' ExpertAct (`host_act`), or None; the
        # CPU branch of a captured step reads it (the block passes its own to eager steps)
        self.acts: list[ExpertAct | None] = []
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
        slots = slot_count(config, pool, store.expert_bytes, device, kv_reserve_bytes + others)
        log.info(kv("vram_plan", slots=slots, slot_mb=store.expert_bytes * slots // 2**20,
                    kv_reserve_mb=kv_reserve_bytes // 2**20, other_weights_mb=others // 2**20))
        cache = SlotCache(store.num_layers, store.num_experts, store.hidden, store.intermediate,
                          slots, dtype=store.dtype, device=device,
                          impl="triton" if device.type == "cuda" else "reference", fmt=store.fmt)
        backend = config.backend
        cpu_threads = config.cpu_threads or default_cpu_threads(device)
        if profile is None and backend in ("auto", "hybrid"):
            # the profile of the store's own bank format (its B_H is that format's CPU kernel,
            # its bytes the real ones); measured at a first start like a dense one
            profile = find_profile(host, store.format)
            if profile is None and device.type == "cuda" and config.measure_bw:
                profile = measure_profile_now(host, store.format, cpu_threads)
            if profile is None and store.fmt is not None:
                # no quantized profile and none measured: the dense one's rates, if any
                profile = find_profile(host, store.dtype) or find_profile(host, torch.bfloat16)
                if profile is not None:
                    log.warning(kv("bw_profile_dense_for_quantized", fmt=store.fmt.name,
                                   profile=profile.key["dtype"],
                                   hint=f"run `ft bench bw --format {store.fmt.name}`"))
        q_rule = q_rule_for(profile, config.hybrid_max_fetch)
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
            # hybrid is a candidate only with a q* this machine's profile measured (B_P)
            measured = profile is not None and profile.b_p is not None
            guard = AutoGuard(candidate_rules(choice, q_rule if measured else None))
            log.info(kv("auto_candidates", order=",".join(guard.order), window=guard.window,
                        turn=guard.turn, discard=guard.discard))
        if backend == "hybrid" and profile is None:
            log.warning(kv("no_bw_profile", using=f"B_P={FALLBACK_BP} B_H={FALLBACK_BH}",
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
        if guard is not None:
            follow_guard(guard, streamer, config, cache, store, profile, cfg.top_k)
        rt = cls(backend, cache, store, counters, top_k=cfg.top_k, cpu_threads=cpu_threads,
                 q_rule=q_rule, guard=guard, streamer=streamer, cpu_layers=config.cpu_layers,
                 device=device)
        rt.install(host)
        if backend == "cpu":
            prefill_static(cache, store, slots)
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
            self.acts.append(host_act(b))

    def uninstall(self, host: MoEHost) -> None:
        """Give every MoE block an empty `fused` bank back (a benchmark frees this runtime's
        device copies before installing the next)."""
        for b in host.moe_blocks():
            b.experts = FusedExperts(1, 1, 1)
        self.backends, self.acts = [], []

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
            self.guard.on_step(kind == "decode", tokens)
        streamed = self.streamer is not None and self.streamer.begin_forward(tokens)
        try:
            yield MoEStep("streamed") if streamed else EAGER
        finally:
            if streamed:
                self.streamer.end_forward()
        if self.guard is not None:
            self.guard.end_step()

    def discard_step_timing(self) -> None:
        """The step running now compiled or captured kernels: `auto`'s guard leaves it
        untimed (called by the decode runner when it captures a graph inside a step)."""
        if self.guard is not None:
            self.guard.discard_step()

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
        acts = self.acts or [None] * L

        def compute(m: int, x: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
            act = acts[m]
            return cpu_branch(x, ids, mask, store, m, threads,
                              None if act is None else act.bind(ids))

        # (timed for re-profiling when that is on: experts/bw_track.py)
        branch = timed_branch(compute, self.counters, store.expert_bytes)
        # the native step loop has the plain SwiGLU only: with any act (gpt-oss's biases,
        # DeepSeek-V4's clamp) the layers take the Python loop (cpu_branch with the host act)
        bridge = CpuBridge(L, max_batch, k, store.hidden, store.dtype, self.device, branch,
                           banks=None if any(a is not None for a in acts) else banks,
                           threads=threads,
                           sample=native_sampler(self.counters, store.expert_bytes))
        self._bridges.append(bridge)
        log.info(kv("cpu_bridge", layers=len(layers), rows=max_batch, threads=threads,
                    loop="native" if bridge.native is not None else "python"))
        return bridge

    def drop_bridge(self, bridge: CpuBridge) -> None:
        """Stop a bridge the engine no longer uses (its worker failed)."""
        bridge.close()
        if bridge in self._bridges:
            self._bridges.remove(bridge)
        if self.guard is not None:  # auto's timings were taken on the bridge's path
            self.guard.retime("bridge_dropped")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every CPU bridge's worker (process shutdown): each finishes the step it is in
        and returns; a worker that does not within `timeout_s` is left (a daemon thread)."""
        for bridge in self._bridges:
            bridge.close()
        for bridge in self._bridges:
            bridge.join(timeout_s)
        self._bridges.clear()

    def capturable(self, bridge: CpuBridge | None) -> bool:
        """Whether every MoE layer decodes without host syncs given `bridge`: offload fills
        from the device, the CPU-branch backends (and `auto`, whichever rule its guard runs)
        hand off through the bridge."""
        return all(b.device_fill or bridge is not None for b in self.backends)

    @property
    def computes_on_cpu(self) -> bool:
        """Whether a backend of this runtime runs experts on the CPU (`cpu`, `hybrid`, `auto`):
        the C++ CPU kernels are then built at load (models/loader.py `place_model`)."""
        return self.backend in ("cpu", "hybrid", "auto")

    @property
    def reprofiler(self) -> Reprofiler | None:
        return self.counters.reprofiler

    def enable_reprofile(self, every_steps: int = REPROFILE_EVERY_STEPS, drift: float = DRIFT,
                         min_bytes: int | None = None) -> Reprofiler | None:
        """Re-measure B_P and B_H from decode traffic and re-derive q* at safe points
        (experts/bw_track.py). Only the q* split has figures to follow (hybrid, and auto
        whichever way its guard chose); None otherwise."""
        if not isinstance(self.q_rule, QStarRule) or self.backend not in ("hybrid", "auto"):
            return None
        kw = {} if min_bytes is None else {"min_bytes": min_bytes}
        rp = Reprofiler(self.q_rule, self.backends, every_steps, drift, **kw)
        self.counters.reprofiler = rp
        log.info(kv("bw_reprofile_on", every_steps=every_steps, drift=drift,
                    b_p=f"{self.q_rule.b_p:.2f}", b_h=f"{self.q_rule.b_h:.2f}"))
        return rp

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
        out = {"backend": self.backend, "slots": self.cache.num_slots,
               **self.counters.as_dict()}
        if self.reprofiler is not None:
            out["bandwidth"] = self.reprofiler.stats()
        if self.guard is not None:
            out["auto"] = self.guard.summary()
        return out


def host_act(block) -> ExpertAct | None:
    """An unbound host copy of a MoE block's `expert_act()` (None without one): an ExpertAct,
    or any object with its fields (`kind` "oai" when it has none: gpt-oss's; "clamp" with
    `gate_up_bias` / `down_bias` None for DeepSeek-V4's), copied so that the CPU branch of a
    captured step reads no device tensor."""
    act = block.expert_act() if hasattr(block, "expert_act") else None
    if act is None:
        return None
    if not isinstance(act, ExpertAct):
        act = ExpertAct(float(getattr(act, "alpha", 0.0)), float(act.limit), act.gate_up_bias,
                        act.down_bias, kind=getattr(act, "kind", "oai"))
    return act.host_copy()


def _bank(p: Tensor | QuantBank) -> Tensor | QuantBank:
    """A block's bank as the store takes it (a parameter's data, a quantized bank as is)."""
    return p if isinstance(p, QuantBank) else p.data


def _dense_dtype(host: MoEHost) -> torch.dtype:
    """The model's activation dtype (its first non-expert parameter's)."""
    return next((p.dtype for n, p in host.named_parameters() if ".experts." not in n),
                torch.float32)

