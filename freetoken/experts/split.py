"""`cpu` and `hybrid`: a layer's misses split between the slot cache and the CPU.

Each (t, k) entry is computed by exactly one branch from the same weights and the same token
group as under `fused`, so in fp32 every slot backend is bit-identical to `fused`:

- cpu:    compute every miss on the CPU from the host store (the cache is filled once, at start,
          with whole layers in order — llama.cpp's static split — and never changes);
- hybrid: fetch q misses (q* from the bandwidth profile, at least one so the cache keeps
          warming), compute the rest on the CPU concurrently; the CPU branch starts first.

`FetchRule` says how many of a step's m misses a layer fetches. `CpuSplitExperts` is also the
base of `offload` (experts/offload.py: fetch every miss) and `auto` (experts/auto.py: the rule
its guard runs).

Shapes: T tokens, K top-k, H hidden, S slots, E experts per layer.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from freetoken.experts.base import ExpertBackend, SharedWeights
from freetoken.experts.cost_model import q_star, q_star_overlapped
from freetoken.experts.ffn import dispatch_experts, run_experts
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.store import ExpertStore
from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.quant import QuantBank
from freetoken.types.forward_batch import MoEStep

# one long-lived worker for the CPU branch (a thread per layer and step costs ~0.1 ms)
_CPU_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-cpu-experts")


def cpu_branch(x: Tensor, ids: Tensor, mask: Tensor, store: ExpertStore, layer: int,
               num_threads: int | None = None, act: ExpertAct | None = None) -> Tensor:
    """y [T, K, H] (model dtype) for the masked entries, computed on the CPU from the store
    (`act`: the layer's ExpertAct, bound to `ids`, or None)."""
    xc, ic, mc = x.cpu(), ids.cpu(), mask.cpu()
    act = None if act is None else act.to("cpu")
    gu, dn = store.gate_up(layer), store.down(layer)
    if gu.dtype == torch.float32 or isinstance(gu, QuantBank):
        # fp32 and quantized banks: the same function as `fused` on the CPU (grouped F.linear,
        # or the C++ kernel for a single decode row), so results are bit-identical
        y = torch.zeros(*ic.shape, xc.shape[-1], dtype=xc.dtype)
        return dispatch_experts(xc, ic, gu, dn, y, mask=mc, num_threads=num_threads, act=act)
    from freetoken.kernels.cpu.expert_ops import cpu_experts

    return cpu_experts(xc, ic, gu, dn, compute_mask=mc, num_threads=num_threads,
                       act=act).to(x.dtype)


class FetchRule:
    """How many of a step's `m` misses a layer fetches (-1: all); the rest go to the CPU.
    `fixed`: the count when it does not depend on m (no miss count needed: no sync)."""

    fixed: int | None = None

    def __call__(self, misses: int) -> int:
        raise NotImplementedError

    def table(self, experts: int) -> list[int]:
        """The rule for m = 0..E, which a captured step's decision indexes on the device."""
        return [self(m) for m in range(experts + 1)]


class FixedRule(FetchRule):
    """`offload` (-1: every miss) or `cpu` (0: none)."""

    def __init__(self, q: int):
        self.fixed = q

    def __call__(self, misses: int) -> int:
        return self.fixed  # type: ignore[return-value]


class QStarRule(FetchRule):
    """`hybrid`: q* = the fetch count that balances the link (B_P) against the CPU (B_H), from
    the measured concurrent pair when the profile has one (q* = m·B_P'/(B_P' + B_H'))."""

    def __init__(self, b_p: float, b_h: float, overlap: bool, max_fetch: int | None = None):
        self.b_p, self.b_h, self.overlap, self.max_fetch = b_p, b_h, overlap, max_fetch

    def __call__(self, misses: int) -> int:
        f = q_star_overlapped if self.overlap else q_star
        return f(misses, self.b_p, self.b_h, self.max_fetch)


class CpuSplitExperts(ExpertBackend):
    """One MoE layer's view of the shared slot cache whose misses `rule` splits between
    fetches and the CPU branch. Built complete by `create_backend`; nothing is set on it
    afterwards."""

    def __init__(self, name: str, moe_index: int, cache: SlotCache, store: ExpertStore,
                 stats, rule: FetchRule, cpu_threads: int | None = None, streamer=None):
        super().__init__()
        self.name = name
        self.m, self.cache, self.store, self.stats = moe_index, cache, store, stats
        self.rule = rule
        self.cpu_threads = cpu_threads  # CPU branch threads (None: torch's thread count)
        self.streamer = streamer  # prefill streaming (experts/streamer.py), `streamed` steps
        self._fetch_table: Tensor | None = None  # rule(m) for m = 0..E, on the device

    # -- what the runtime asks ----------------------------------------------------------------

    def all_fetched(self, entries: int) -> bool:
        """Whether offload can fetch every miss of a step of `entries` (token, k) pairs: the
        slots hold every distinct expert it can route (else the decision sends the overflow to
        the CPU, which the device-driven path alone cannot compute)."""
        return self.cache.num_slots >= min(entries, self.store.num_experts)

    @property
    def device_fill(self) -> bool:
        return False

    def needs_bridge(self, max_entries: int) -> bool:
        return not (self.device_fill and self.all_fetched(max_entries))

    # -- forward -------------------------------------------------------------------------------

    def forward(self, x: Tensor, topk_ids: Tensor, step: MoEStep,
                shared: SharedWeights = None, act: ExpertAct | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """y [T, K, H] (ExpertBackend's contract), and the shared expert's output [T, H] when
        it rode the launches of the GPU's share (decode-sized steps on CUDA), else None."""
        T, K = topk_ids.shape
        if step.mode == "streamed":
            return self.streamer.forward(self.m, x, topk_ids, act), None
        br = step.bridge
        if step.mode == "captured" and br is not None and self.needs_bridge(br.B * br.K):
            return self._forward_bridged(x, topk_ids, shared, br, act)
        if self.device_fill and self.all_fetched(T * K):
            return self._forward_device(x, topk_ids, shared, act)
        return self._forward_synced(x, topk_ids, shared, act)

    def _forward_device(self, x: Tensor, topk_ids: Tensor, shared: SharedWeights,
                        act: ExpertAct | None = None) -> tuple[Tensor, Tensor | None]:
        """Every miss fetched by the device itself: no host sync (offload, capturable)."""
        d = self.cache.decide(self.m, topk_ids, -1,
                              accumulate=self.stats.device_counters(self.cache.device))
        self.cache.fill_device(self.m, d.fetch_experts, d.fetch_slots, self.store)
        return run_experts(x, d.slot_ids, self.cache.gate_up_slots, self.cache.down_slots, shared,
                           act)

    def _device_num_fetch(self) -> int | Tensor:
        """The fetch count for a captured step: the fixed count, or the rule as a table [E+1]
        which the decision indexes on the device with the misses it counts itself (the same q
        as the eager path, no extra launches)."""
        if self.rule.fixed is not None:
            return self.rule.fixed
        if self._fetch_table is None:
            self._fetch_table = torch.tensor(self.rule.table(self.store.num_experts),
                                             dtype=torch.int64, device=self.cache.device)
        return self._fetch_table

    def _forward_bridged(self, x: Tensor, topk_ids: Tensor, shared: SharedWeights, bridge,
                         act: ExpertAct | None = None) -> tuple[Tensor, Tensor | None]:
        """The layer inside a captured step: decide on the device, hand the CPU share to the
        bridge's worker, fill and compute the rest meanwhile, merge."""
        d = self.cache.decide(self.m, topk_ids, self._device_num_fetch(),
                              accumulate=self.stats.device_counters(self.cache.device))
        bridge.send(self.m, x, topk_ids, d.cpu_mask)
        if self.cache.can_fill_on_device(self.store):
            self.cache.fill_device(self.m, d.fetch_experts, d.fetch_slots, self.store)
        else:  # the CPU device (tests): host lists are free there
            self.cache.fill(self.m, d.fetch_experts, d.fetch_slots, self.store)
        y, ys = run_experts(x, d.slot_ids, self.cache.gate_up_slots, self.cache.down_slots,
                            shared, act)  # [T, K, H]: zeros on the CPU's entries until the merge
        return bridge.receive(self.m, d.cpu_mask, y), ys

    def _forward_synced(self, x: Tensor, topk_ids: Tensor, shared: SharedWeights,
                        act: ExpertAct | None = None) -> tuple[Tensor, Tensor | None]:
        """The eager path: one device-to-host read for the decision; the CPU branch first, on
        its worker, while this thread fills slots and computes the hits."""
        q = self.rule.fixed if self.rule.fixed is not None else self.rule(
            self._count_misses(topk_ids))
        d = self.cache.decide(self.m, topk_ids, q)
        # one device-to-host read for the counters and both fetch lists (a single sync)
        F = d.fetch_experts.numel()
        host = torch.cat([d.counters, d.fetch_experts, d.fetch_slots]).cpu()  # [3 + 2F]
        hits, miss, fetched = (int(v) for v in host[:3].tolist())
        fetch_experts, fetch_slots = host[3:3 + F], host[3 + F:]
        n_cpu = miss - fetched
        self.stats.add_host(hits, miss, fetched, self.store.expert_bytes)
        worker: Future | None = None
        rp = self.stats.reprofiler  # re-profiling (experts/bw_track.py): time both branches
        if n_cpu:
            worker = _CPU_POOL.submit(self._cpu_share, x, topk_ids, d.cpu_mask, n_cpu, act)
        t_fill = rp.link_begin(self.cache.device) if rp is not None and fetched else None
        self.cache.fill(self.m, fetch_experts, fetch_slots, self.store)
        if t_fill is not None:
            rp.link_end(t_fill, fetched * self.store.expert_bytes)
        y, ys = run_experts(x, d.slot_ids, self.cache.gate_up_slots, self.cache.down_slots,
                            shared, act)  # [T, K, H]
        if worker is not None:
            cm = d.cpu_mask.to(x.device)
            y[cm] = worker.result().to(x.device)[cm]
        return y, ys

    def _cpu_share(self, x: Tensor, topk_ids: Tensor, mask: Tensor, n_cpu: int,
                   act: ExpertAct | None = None) -> Tensor:
        """The CPU branch on its worker (`n_cpu` experts), timed when re-profiling is on."""
        rp = self.stats.reprofiler
        t0 = time.perf_counter()
        y = cpu_branch(x, topk_ids, mask, self.store, self.m, self.cpu_threads, act)
        if rp is not None:
            rp.host_sample(n_cpu * self.store.expert_bytes, time.perf_counter() - t0)
        return y

    def _count_misses(self, topk_ids: Tensor) -> int:
        g = topk_ids.reshape(-1).unique() + self.m * self.store.num_experts
        return int((self.cache.table.expert_slot[g.to(self.cache.device)] < 0).sum())
