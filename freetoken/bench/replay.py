"""Replay routing traces through expert-cache policies at equal capacity; count misses.

Miss rate = misses / routed distinct experts, over decode steps only (per layer and step an
expert counts once). Each sequence is replayed alone on a fresh cache seeded by its prompt.

Policies (all hold at most `slots` experts of the L*E pool):
- `lru`: the global LRU of residency.py, every miss fetched (`num_fetch=-1`). Seeded by
  replaying the prompt token by token, so its recency at the first decode step is the prompt's.
  `impl="fast"` is an exact pure-Python model of the same decision (tested equal to the
  reference); "reference" and "triton" run the real decision through a ResidencyTable.
- `prefill_hot` (KTransformers-style): each layer pins its `slots/L` most frequent prompt experts
  (ties: lowest id; the remainder slot count goes to the first layers); never updated in decode.
- `static_layers` (llama.cpp `--n-cpu-moe` style): `slots // E` whole layers resident, the last
  ones by position (the first layers' experts stay on the CPU); leftover slots go unused.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from freetoken.bench.routing_trace import RoutingTrace
from freetoken.experts.residency import ResidencyTable

POLICIES = ("lru", "prefill_hot", "static_layers")


class FastLru:
    """Exact model of `decide(layer, ids, num_fetch=-1)` on counters, without tensors."""

    def __init__(self, num_experts: int, num_slots: int) -> None:
        self.E = num_experts
        self.lru: OrderedDict[int, int] = OrderedDict()  # global id -> slot, LRU first
        self.free = list(range(num_slots - 1, -1, -1))  # pop() yields the lowest free slot
        self.num_slots = num_slots

    def step(self, layer: int, ids: Sequence[int]) -> tuple[int, int]:
        """One layer step over the routed ids of its tokens; returns (hits, misses)."""
        base = layer * self.E
        cnt = Counter(ids)
        lru = self.lru
        hits = [base + e for e in cnt if base + e in lru]
        misses = sorted((e for e in cnt if base + e not in lru), key=lambda e: (-cnt[e], e))
        q = min(len(misses), self.num_slots - len(hits))
        victims: list[int] = []
        while self.free and len(victims) < q:
            victims.append(self.free.pop())
        if len(victims) < q:
            hit_set = set(hits)
            evict: list[int] = []
            for g in lru:  # LRU first; the hits of this step are protected
                if g not in hit_set:
                    evict.append(g)
                    if len(victims) + len(evict) == q:
                        break
            victims.extend(lru.pop(g) for g in evict)
        touched = sorted([(lru[g], g) for g in hits] +
                         [(s, base + e) for e, s in zip(misses[:q], victims)])
        for s, g in touched:  # equal recency: ascending slot order, as the spec's tie-break
            lru[g] = s
            lru.move_to_end(g)
        return len(hits), len(misses)


def lru_miss_rate(
    decode: np.ndarray, num_experts: int, num_slots: int, warmup: int = 0,
    prefill: np.ndarray | None = None,
) -> float:
    """Fast global-LRU miss rate of one sequence `decode [steps, L, K]` (prefill `[L, T, K]`)."""
    misses, total = _fast_lru_counts(decode, num_experts, num_slots, warmup, prefill)
    return misses / max(total, 1)


def _fast_lru_counts(
    decode: np.ndarray, num_experts: int, num_slots: int, warmup: int,
    prefill: np.ndarray | None,
) -> tuple[int, int]:
    sim = FastLru(num_experts, num_slots)
    if prefill is not None:
        pre = prefill.transpose(1, 0, 2).tolist()  # [T, L, K]
        for tok in pre:
            for layer, ids in enumerate(tok):
                sim.step(layer, ids)
    misses = total = 0
    for t, step in enumerate(decode.tolist()):
        for layer, ids in enumerate(step):
            h, m = sim.step(layer, ids)
            if t >= warmup:
                misses += m
                total += h + m
    return misses, total


def _decide_lru_counts(
    decode: np.ndarray, num_experts: int, num_slots: int, prefill: np.ndarray | None,
    impl: str, device: str,
) -> tuple[int, int]:
    num_layers = decode.shape[1]
    table = ResidencyTable(num_layers, num_experts, num_slots, device)
    if prefill is not None:
        pre = torch.from_numpy(prefill.astype(np.int64)).to(device)  # [L, T, K]
        for t in range(pre.shape[1]):
            for layer in range(num_layers):
                table.decide(layer, pre[layer, t][None], -1, impl=impl)
    dec = torch.from_numpy(decode.astype(np.int64)).to(device)  # [steps, L, K]
    acc = torch.zeros(3, dtype=torch.int64, device=device)  # hits, misses, fetched
    for t in range(dec.shape[0]):
        for layer in range(num_layers):
            acc += table.decide(layer, dec[t, layer][None], -1, impl=impl).counters
    hits, misses = int(acc[0]), int(acc[1])  # the only host sync of the replay
    return misses, hits + misses


def _prefill_hot_counts(decode: np.ndarray, prefill: np.ndarray | None, num_experts: int,
                        num_slots: int) -> tuple[int, int]:
    num_layers = decode.shape[1]
    share = [num_slots // num_layers + (layer < num_slots % num_layers)
             for layer in range(num_layers)]
    pinned = np.zeros((num_layers, num_experts), bool)  # [L, E]
    for layer in range(num_layers):
        counts = np.zeros(num_experts, np.int64)  # [E]
        if prefill is not None:
            counts = np.bincount(prefill[layer].reshape(-1), minlength=num_experts)
        order = np.lexsort((np.arange(num_experts), -counts))  # count desc, id asc
        pinned[layer, order[: min(share[layer], num_experts)]] = True
    return _resident_counts(decode, pinned)


def _static_layers_counts(decode: np.ndarray, num_experts: int,
                          num_slots: int) -> tuple[int, int]:
    num_layers = decode.shape[1]
    n_res = min(num_layers, num_slots // num_experts)
    resident = np.zeros((num_layers, num_experts), bool)  # [L, E]
    resident[num_layers - n_res:] = True
    return _resident_counts(decode, resident)


def _resident_counts(decode: np.ndarray, resident: np.ndarray) -> tuple[int, int]:
    """Misses/total of a fixed resident set `[L, E]` over `decode [steps, L, K]`."""
    num_layers = decode.shape[1]
    ids = np.sort(decode.astype(np.int64), axis=2)  # [steps, L, K]
    distinct = np.ones(ids.shape, bool)  # a repeated id in one step counts once
    distinct[:, :, 1:] = ids[:, :, 1:] != ids[:, :, :-1]
    layer_idx = np.broadcast_to(np.arange(num_layers)[None, :, None], ids.shape)
    hit = resident[layer_idx, ids]  # [steps, L, K]
    return int((distinct & ~hit).sum()), int(distinct.sum())


def replay(trace: RoutingTrace, policy: str, num_slots: int, lru_impl: str = "fast",
           device: str = "cpu", max_sequences: int | None = None) -> float:
    """Miss rate of `policy` with `num_slots` slots over the trace's sequences."""
    misses = total = 0
    n = trace.num_sequences if max_sequences is None else min(max_sequences, trace.num_sequences)
    for i in range(n):
        decode = trace.decode[i]  # [steps, L, K]
        prefill = None if trace.prefill is None else trace.prefill[i]  # [L, T, K]
        if policy == "lru" and lru_impl == "fast":
            m, t = _fast_lru_counts(decode, trace.num_experts, num_slots, 0, prefill)
        elif policy == "lru":
            m, t = _decide_lru_counts(decode, trace.num_experts, num_slots, prefill,
                                      lru_impl, device)
        elif policy == "prefill_hot":
            m, t = _prefill_hot_counts(decode, prefill, trace.num_experts, num_slots)
        elif policy == "static_layers":
            m, t = _static_layers_counts(decode, trace.num_experts, num_slots)
        else:
            raise ValueError(f"unknown policy {policy!r} ({', '.join(POLICIES)})")
        misses += m
        total += t
    return misses / max(total, 1)
