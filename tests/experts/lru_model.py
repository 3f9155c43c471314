"""An independent model of the global expert LRU (OrderedDict), the oracle for decide_reference.

It knows nothing of the tensor tables: residents are an OrderedDict `global id -> slot` in
least-recently-used-first order; free slots are a set. Within one step, touched experts move to
the end in ascending slot order (the spec's tie-break: equal last_use -> lowest slot first).
"""
from __future__ import annotations

from collections import Counter, OrderedDict


class LruModel:
    def __init__(self, num_experts: int, num_slots: int) -> None:
        self.E = num_experts
        self.S = num_slots
        self.lru: OrderedDict[int, int] = OrderedDict()  # global id -> slot, LRU first
        self.step_of: dict[int, int] = {}  # global id -> step that last touched it
        self.steps = 0

    def free_slots(self) -> list[int]:
        return sorted(set(range(self.S)) - set(self.lru.values()))

    def step(
        self, layer: int, ids: list[list[int]], num_fetch: int
    ) -> tuple[list[list[int]], list[int], list[int], tuple[int, int, int]]:
        """Returns (slot_ids, fetch_experts, fetch_slots, (hits, misses, fetched))."""
        self.steps += 1
        base = layer * self.E
        cnt = Counter(x for row in ids for x in row if x >= 0)
        hits = [e for e in cnt if base + e in self.lru]
        misses = sorted((e for e in cnt if base + e not in self.lru), key=lambda e: (-cnt[e], e))
        allowed = len(misses) if num_fetch < 0 else min(num_fetch, len(misses))
        q = min(allowed, self.S - len(hits))
        fetch = misses[:q]
        hit_g = {base + e for e in hits}
        order = self.free_slots() + [s for g, s in self.lru.items() if g not in hit_g]
        victims = order[:q]
        owner = {s: g for g, s in self.lru.items()}
        for v in victims:
            if v in owner:
                del self.lru[owner[v]]
        touched = {self.lru[g]: g for g in hit_g}
        for e, v in zip(fetch, victims):
            self.lru[base + e] = v
            touched[v] = base + e
        for s in sorted(touched):
            self.lru.move_to_end(touched[s])
            self.step_of[touched[s]] = self.steps
        slot_ids = [[self.lru.get(base + x, -1) if x >= 0 else -1 for x in row] for row in ids]
        return slot_ids, fetch, victims, (len(hits), len(misses), q)

    def resize(self, num_slots: int) -> None:
        """Shrink evicts LRU first, survivors past the end move to the lowest free slots."""
        if num_slots >= self.S:
            self.S = num_slots
            return
        for g in list(self.lru)[: max(0, len(self.lru) - num_slots)]:
            del self.lru[g]
        used = set(self.lru.values())
        free = [s for s in range(num_slots) if s not in used]
        movers = sorted((s, g) for g, s in self.lru.items() if s >= num_slots)
        for (_, g), dst in zip(movers, free):
            self.lru[g] = dst
        self.S = num_slots
        # a move changes slot indices, so re-establish the (last touch, slot) order
        items = sorted(self.lru.items(), key=lambda gs: (self.step_of[gs[0]], gs[1]))
        self.lru = OrderedDict(items)
