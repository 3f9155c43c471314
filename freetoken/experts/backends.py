"""Expert backends: where each routed (token, expert) pair is computed.

All return per (token, k) UNWEIGHTED outputs y [T, K, H]; the MoE block merges them. Each
(t, k) entry is computed by exactly one branch from the same weights and the same token group
as under `fused`, so in fp32 every backend is bit-identical to `fused`.

- offload: fetch every miss into the slot cache, compute everything from slots.
- cpu:     compute every miss on the CPU from the host store (the cache is filled once, at
           start, with whole layers in order — llama.cpp's static split — and never changes).
- hybrid:  fetch q misses (q* from the bandwidth profile, at least one so the cache keeps
           warming), compute the rest on the CPU concurrently; the CPU branch starts first.

Shapes: T tokens, K top-k, H hidden, S slots.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from freetoken.experts.cpu_bridge import CpuBridge
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.store import ExpertStore
from freetoken.experts.streamer import LayerStreamer
from freetoken.layers.expert_backend import ExpertBackend
from freetoken.layers.moe import dispatch_experts, run_experts
from freetoken.log import get_logger, kv

log = get_logger("experts")
# one long-lived worker for the CPU branch (a thread per layer and step costs ~0.1 ms)
_CPU_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-cpu-experts")
# a block's shared expert: gate_up [2I, H], down [H, I]
SharedWeights = tuple[Tensor, Tensor] | None


def cpu_branch(x: Tensor, ids: Tensor, mask: Tensor, store: ExpertStore, layer: int,
               num_threads: int | None = None) -> Tensor:
    """y [T, K, H] (model dtype) for the masked entries, computed on the CPU from the store."""
    xc, ic, mc = x.cpu(), ids.cpu(), mask.cpu()
    gu, dn = store.gate_up(layer), store.down(layer)
    if gu.dtype == torch.float32:
        # fp32: the same function as `fused` on the CPU (grouped F.linear, or the C++ kernel for
        # a single decode row), so results are bit-identical
        y = torch.zeros(*ic.shape, xc.shape[-1], dtype=xc.dtype)
        return dispatch_experts(xc, ic, gu, dn, y, mask=mc, num_threads=num_threads)
    from kernels.cpu.expert_ops import cpu_experts

    return cpu_experts(xc, ic, gu, dn, compute_mask=mc, num_threads=num_threads).to(x.dtype)


class MoEStats:
    """Counters shared by the backends of one model (hit rate, bytes moved, CPU work)."""

    def __init__(self, expert_bytes: int = 0) -> None:
        self.hits = self.misses = self.fetched = self.cpu_experts = self.steps = 0
        self.fetch_bytes = self.cpu_bytes = 0
        self.streamed = self.stream_bytes = 0  # experts / bytes moved by prefill streaming
        self.expert_bytes = expert_bytes
        # (hits, misses, fetched) summed on the device by layers that never sync (device fills);
        # folded into the host counters when read
        self._dev: Tensor | None = None
        self._dev_stream: Tensor | None = None  # (hits, misses) of streamed layers

    def add_stream(self, counters: Tensor) -> None:
        """Accumulate a streamed layer's routed (hits, misses) [2] without reading them."""
        if self._dev_stream is None:
            self._dev_stream = torch.zeros(2, dtype=torch.int64, device=counters.device)
        self._dev_stream.add_(counters)

    def device_counters(self, device: torch.device) -> Tensor:
        """The running (hits, misses, fetched) [3] on `device` that decisions of layers which
        never sync add their counters to (`SlotCache.decide(accumulate=...)`: in the decision
        kernel itself); folded into the host counters by `sync`. Its address stays fixed, so
        captured steps may hold it."""
        if self._dev is None:
            self._dev = torch.zeros(3, dtype=torch.int64, device=device)
        return self._dev

    def sync(self) -> None:
        """Fold the device counters into the host ones (one device read)."""
        if self._dev_stream is not None:
            hits, miss = (int(v) for v in self._dev_stream.tolist())
            with torch.inference_mode():
                self._dev_stream.zero_()
            self.hits += hits
            self.misses += miss
        if self._dev is None:
            return
        hits, miss, fetched = (int(v) for v in self._dev.tolist())
        with torch.inference_mode():  # the counters were made inside the model's forward
            self._dev.zero_()
        self.hits += hits
        self.misses += miss
        self.fetched += fetched
        self.fetch_bytes += fetched * self.expert_bytes
        self.cpu_experts += miss - fetched
        self.cpu_bytes += (miss - fetched) * self.expert_bytes

    def as_dict(self) -> dict:
        self.sync()
        routed = self.hits + self.misses
        return {"hit_rate": round(self.hits / routed, 4) if routed else 0.0, "hits": self.hits,
                "misses": self.misses, "fetched": self.fetched, "cpu_experts": self.cpu_experts,
                "fetch_bytes": self.fetch_bytes, "cpu_bytes": self.cpu_bytes,
                "streamed": self.streamed, "stream_bytes": self.stream_bytes}


class SlotExperts(ExpertBackend):
    """One MoE layer's view of the shared slot cache. `num_fetch(m)` says how many of m misses
    to fetch this step (-1 = all)."""

    def __init__(self, moe_index: int, cache: SlotCache, store: ExpertStore, stats: MoEStats,
                 num_fetch: Callable[[int], int], name: str, fixed_fetch: int | None = None,
                 cpu_threads: int | None = None):
        super().__init__()
        self.m, self.cache, self.store, self.stats = moe_index, cache, store, stats
        self.num_fetch, self.name = num_fetch, name
        self.fixed_fetch = fixed_fetch  # offload (-1) and cpu (0) need no miss count: no sync
        self.cpu_threads = cpu_threads  # CPU branch threads (None: torch's thread count)
        self.guard: AutoGuard | None = None  # `auto`: its steps are marked by the step's runner
        self._device_fill: bool | None = None  # decided on first use (see device_fill)
        self._fetch_table: Tensor | None = None  # num_fetch(m) for m = 0..E, on the device
        self.bridge: CpuBridge | None = None  # the CPU branch of captured steps (decode runner)
        self.streamer: LayerStreamer | None = None  # prefill streaming (experts/streamer.py)

    def all_fetched(self, entries: int) -> bool:
        """Whether offload can fetch every miss of a step of `entries` (token, k) pairs: the
        slots hold every distinct expert it can route (else the decision sends the overflow to
        the CPU, which the device-driven path alone cannot compute)."""
        return self.cache.num_slots >= min(entries, self.store.num_experts)

    @property
    def capturable(self) -> bool:
        """Whether a decode step through this layer can be captured in a CUDA graph: offload
        with device-driven fills, or a CPU branch handed off through the bridge (`auto` too:
        its guard switches the fetch rule between steps by rewriting the table the graph
        reads)."""
        return self.device_fill or self.bridge is not None

    def needs_bridge(self, max_entries: int) -> bool:
        """Whether the decode runner must give this layer a CPU bridge: it can send work to
        the CPU in a decode step of up to `max_entries` pairs."""
        return not (self.device_fill and self.all_fetched(max_entries))

    def _device_num_fetch(self) -> int | Tensor:
        """`num_fetch` for a captured step: the fixed count, or the rule as a table [E+1] of
        `num_fetch(m)` per miss count m, which the decision indexes on the device with the
        misses it counts itself (the same q as the eager path, no extra launches). Under
        `auto` the guard's rule changes with its phase: the table is rewritten in place when
        it does (the graph holds its address)."""
        if self.fixed_fetch is not None:
            return self.fixed_fetch
        if self._fetch_table is None:
            self._fetch_table = torch.tensor(self._fetch_rule(), dtype=torch.int64,
                                             device=self.cache.device)
            if self.guard is not None:
                self.guard.listeners.append(self._refresh_fetch_table)
        return self._fetch_table

    def _fetch_rule(self) -> list[int]:
        return [self.num_fetch(m) for m in range(self.store.num_experts + 1)]

    def _refresh_fetch_table(self) -> None:
        """The guard changed phase: the table takes the rule it follows now (between steps;
        the guard's caller has the step's tokens, so no replay reads the table meanwhile)."""
        assert self._fetch_table is not None
        with torch.inference_mode():  # the table was made inside a forward
            self._fetch_table.copy_(torch.tensor(self._fetch_rule(), dtype=torch.int64))

    def _forward_bridged(self, x: Tensor, topk_ids: Tensor, shared: SharedWeights
                         ) -> tuple[Tensor, Tensor | None]:
        """The hybrid/cpu layer inside a captured step: decide on the device, hand the CPU
        share to the bridge's worker, fill and compute the rest meanwhile, merge."""
        assert self.bridge is not None
        d = self.cache.decide(self.m, topk_ids, self._device_num_fetch(),
                              accumulate=self.stats.device_counters(self.cache.device))
        self.bridge.send(self.m, x, topk_ids, d.cpu_mask)
        if self.cache.can_fill_on_device(self.store):
            self.cache.fill_device(self.m, d.fetch_experts, d.fetch_slots, self.store)
        else:  # the CPU device (tests): host lists are free there
            self.cache.fill(self.m, d.fetch_experts, d.fetch_slots, self.store)
        y, ys = run_experts(x, d.slot_ids, self.cache.gate_up_slots, self.cache.down_slots,
                            shared)  # [T, K, H]: zeros on the CPU's entries until the merge
        return self.bridge.receive(self.m, d.cpu_mask, y), ys

    @property
    def device_fill(self) -> bool:
        """Offload with fills driven by the device: no host sync in the layer, capturable."""
        if self._device_fill is None:
            self._device_fill = (self.fixed_fetch == -1 and self.guard is None
                                 and self.cache.can_fill_on_device(self.store))
        return self._device_fill

    def forward(self, layer: int, x: Tensor, topk_ids: Tensor) -> Tensor:
        return self.forward_with_shared(layer, x, topk_ids)[0]

    def forward_with_shared(self, layer: int, x: Tensor, topk_ids: Tensor,
                            shared: SharedWeights = None) -> tuple[Tensor, Tensor | None]:
        """y [T, K, H] (ExpertBackend's contract), and the shared expert's output [T, H] when
        it rode the launches of the GPU's share (decode-sized steps on CUDA), else None."""
        if layer != self.m:
            raise ValueError(f"MoE layer {layer} called the backend of layer {self.m}")
        T, K = topk_ids.shape
        if self.streamer is not None and self.streamer.active:
            return self.streamer.forward(self.m, x, topk_ids), None
        if self.bridge is not None and self.bridge.active:
            return self._forward_bridged(x, topk_ids, shared)
        if self.device_fill and self.all_fetched(T * K):
            d = self.cache.decide(self.m, topk_ids, -1,
                                  accumulate=self.stats.device_counters(self.cache.device))
            self.cache.fill_device(self.m, d.fetch_experts, d.fetch_slots, self.store)
            return run_experts(x, d.slot_ids, self.cache.gate_up_slots, self.cache.down_slots,
                               shared)
        q = (self.fixed_fetch if self.fixed_fetch is not None
             else self.num_fetch(self._count_misses(topk_ids)))
        d = self.cache.decide(self.m, topk_ids, q)
        # one device-to-host read for the counters and both fetch lists (a single sync)
        F = d.fetch_experts.numel()
        host = torch.cat([d.counters, d.fetch_experts, d.fetch_slots]).cpu()  # [3 + 2F]
        hits, miss, fetched = (int(v) for v in host[:3].tolist())
        fetch_experts, fetch_slots = host[3:3 + F], host[3 + F:]
        st, eb = self.stats, self.store.expert_bytes
        st.hits += hits
        st.misses += miss
        st.fetched += fetched
        st.fetch_bytes += fetched * eb
        n_cpu = miss - fetched
        st.cpu_experts += n_cpu
        st.cpu_bytes += n_cpu * eb
        worker: Future | None = None
        if n_cpu:
            # CPU branch first: it runs while this thread fills slots and computes hits
            worker = _CPU_POOL.submit(cpu_branch, x, topk_ids, d.cpu_mask, self.store, self.m,
                                      self.cpu_threads)
        self.cache.fill(self.m, fetch_experts, fetch_slots, self.store)
        y, ys = run_experts(x, d.slot_ids, self.cache.gate_up_slots, self.cache.down_slots,
                            shared)  # [T, K, H]
        if worker is not None:
            cm = d.cpu_mask.to(x.device)
            y[cm] = worker.result().to(x.device)[cm]
        return y, ys

    def _count_misses(self, topk_ids: Tensor) -> int:
        g = topk_ids.reshape(-1).unique() + self.m * self.store.num_experts
        return int((self.cache.table.expert_slot[g.to(self.cache.device)] < 0).sum())


class AutoGuard:
    """`auto`: runs the profile's choice, then guards it on the live workload — after a warm-up
    it times plain offload over the same number of decode steps and falls back to it if the
    choice was slower.

    `on_step` is called once at the start of every forward step by what runs the step
    (`EngineCore.step`, `generate`), with `decode=True` when every row of the step is one token
    of a decoding sequence, however many sequences there are, and `end_step` once its tokens
    are on the host. The caller knows the step's kind; a layer sees only a token count, which
    cannot tell 3 decode rows from a 3-token prefill chunk. Only the decode steps' own durations
    are summed: the time between steps (an idle server, the warm-up before the first request,
    the host's handling of the tokens) is not the backend's."""

    def __init__(self, choice: str, q_choice: Callable[[int], int], window: int = 32):
        self.choice, self.q_choice, self.window = choice, q_choice, window
        self.phase, self.steps, self.elapsed = "choice", 0, 0.0
        self._start: float | None = None  # start of the current decode step, if timed
        self.times: dict[str, float] = {}
        # called after each change of phase (the rule `num_fetch` follows may change with it):
        # captured layers rewrite their device fetch tables
        self.listeners: list[Callable[[], None]] = []

    @property
    def settled(self) -> bool:
        """Done timing: steps need no marking any more (the engine may overlap them)."""
        return self.phase == "settled"

    def num_fetch(self, misses: int) -> int:
        return self.q_choice(misses) if self.phase in ("choice", "settled") else -1

    def on_step(self, decode: bool) -> None:
        self._start = (time.perf_counter() if decode and self.phase != "settled" else None)

    def end_step(self) -> None:
        if self._start is None:
            return
        self.elapsed += time.perf_counter() - self._start
        self._start = None
        self.steps += 1
        if self.steps < self.window:
            return
        self.times[self.phase] = self.elapsed / self.window
        self.steps, self.elapsed = 0, 0.0
        if self.phase == "choice":
            self.phase = "offload"
            self._changed()
            return
        if self.times["offload"] < self.times["choice"]:
            log.warning(kv("auto_fallback", chosen=self.choice, to="offload",
                           chosen_ms=f"{self.times['choice'] * 1e3:.2f}",
                           offload_ms=f"{self.times['offload'] * 1e3:.2f}"))
            self.choice, self.q_choice = "offload", (lambda m: -1)
        else:
            log.info(kv("auto_keep", chosen=self.choice,
                        chosen_ms=f"{self.times['choice'] * 1e3:.2f}",
                        offload_ms=f"{self.times['offload'] * 1e3:.2f}"))
        self.phase = "settled"
        self._changed()

    def _changed(self) -> None:
        for fn in self.listeners:
            fn()
