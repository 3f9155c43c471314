"""Kept logits: the next-token logits of a prompt's last positions, beside the snapshots there.

An exact repeat of a cached prompt of length L needs no forward pass when both the state after
its last token (a snapshot at depth L) and the logits that token produced are kept: the request
samples its first token from the kept row and decodes on from the snapshot. The same holds one
token back (a snapshot at L - 1 and the logits of token L - 2) for a resend that drops the last
token. Prefill keeps both rows of every prompt (`Scheduler`); the hybrid cache matches the whole
prompt only where a snapshot and a kept row sit at the same node (`HybridRadixCache.match`).

Bookkeeping only, over integer slot ids: the engine owns the `[slots, vocab]` tensor the ids
index and writes a row when a planned item says so. A row lives as long as the snapshot at its
node (dropped with it in either tier, or with the node); when every slot is taken, the least
recently used row whose node no running request has locked is taken back.
"""
from __future__ import annotations

from collections.abc import Container, Hashable

from freetoken.cache.state_pool import StatePool
from freetoken.log import get_logger, kv

log = get_logger("cache")

Node = Hashable


class KeptLogits:
    """Which radix node holds which logits slot (see the module docstring). `num_slots` 0:
    nothing is ever kept (every `alloc` is None)."""

    def __init__(self, num_slots: int) -> None:
        self.pool = StatePool(max(num_slots, 0))
        self.at: dict[Node, int] = {}
        self._used: dict[Node, int] = {}  # node -> last use (logical clock)
        self._clock = 0
        self.counters = {"logits_kept": 0, "logits_hits": 0, "logits_reclaimed": 0}

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def alloc(self, pinned: Container[Node]) -> int | None:
        """One caller-owned slot, taking back the least recently used unpinned row if none is
        free; None when there are no slots or every row's node is pinned."""
        if self.pool.num_slots == 0:
            return None
        if self.pool.num_free == 0:
            free = [n for n in self.at if n not in pinned]
            if not free:
                return None
            victim = min(free, key=self._used.__getitem__)
            self.drop(victim)
            self.counters["logits_reclaimed"] += 1
        return self.pool.alloc_one()

    def attach(self, node: Node, slot: int) -> bool:
        """Keep `slot` (written by the engine) at `node`. False when `node` already has a row
        (the same tokens give the same logits): the caller still owns `slot`."""
        if node in self.at:
            self._used[node] = self._tick()
            return False
        self.at[node] = slot
        self._used[node] = self._tick()
        self.counters["logits_kept"] += 1
        return True

    def hit(self, node: Node) -> int:
        """The slot at `node` (which has one), marked used: a request samples from it."""
        self._used[node] = self._tick()
        self.counters["logits_hits"] += 1
        return self.at[node]

    def free(self, slot: int) -> None:
        """Give back a caller-owned slot that was not attached."""
        self.pool.free([slot])

    def drop(self, node: Node) -> None:
        """Forget `node`'s row (if any): its snapshot or the node itself went away."""
        slot = self.at.pop(node, None)
        if slot is None:
            return
        del self._used[node]
        self.pool.free([slot])
        log.debug(kv("logits_drop", slot=slot))

    def stats(self) -> dict[str, int]:
        return dict(self.counters, logits_rows=len(self.at), logits_free=self.pool.num_free)
