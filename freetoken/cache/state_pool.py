"""Slot bookkeeping for recurrent-state (linear-attention) snapshots.

The engine keeps, per linear-attention layer, a conv-state tensor `[N, ...]` and an ssm-state
tensor `[N, ...]` indexed by these slot ids (tens of MB per slot for real models, so `N` is
small). The same pool serves two users:

- running requests: each holds one *working* slot that its forward passes update in place;
- the hybrid radix cache: each snapshot is one slot holding the state that covers exactly the
  tokens `[0, p)` of the prefix ending at its radix node.

A working slot becomes a snapshot without a copy when a finished request donates it
(`HybridRadixCache.insert_snapshot`); a snapshot taken mid-prefill needs a fresh slot (from
`HybridRadixCache.alloc_state`, which evicts snapshots when the pool is full) and a device copy
working -> fresh, done by the engine.
"""
from __future__ import annotations

from freetoken.cache.allocator import SlotAllocator


class StatePool(SlotAllocator):
    """`SlotAllocator` semantics (all-or-nothing `alloc(n)`, checked `free`) over state slots."""

    kind = "state"

    def alloc_one(self) -> int | None:
        """One free slot id owned by the caller, or `None` when the pool is empty."""
        t = self.alloc(1)
        return None if t is None else int(t[0])
