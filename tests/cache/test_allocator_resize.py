"""`SlotAllocator.compaction` / `resize` (the KV pool's elastic rebuild) against a reference
model: a plain set of owned ids relabelled by the returned moves."""
from __future__ import annotations

import random

import pytest

from freetoken.cache.allocator import SlotAllocator


@pytest.mark.parametrize("seed", range(6))
def test_resize_keeps_every_owned_slot_relabelled(seed: int) -> None:
    """Random allocs and frees, then shrinks and grows: the owned set maps one to one through
    the moves, every owned id fits the new size, and the allocator hands out exactly the other
    ids. Bugs caught: a moved slot left marked used at its old id, a free list with ids past
    the new size, an owned slot handed out again."""
    rng = random.Random(seed)
    a = SlotAllocator(64)
    owned: set[int] = set()
    for size in (40, 100, 25, 25, 70):
        for _ in range(30):
            if owned and rng.random() < 0.4:
                x = rng.choice(sorted(owned))
                a.free([x])
                owned.discard(x)
            else:
                got = a.alloc(rng.randint(1, 3))
                if got is not None:
                    owned |= set(got.tolist())
        if len(owned) > size:
            with pytest.raises(ValueError):
                a.compaction(size)
            for x in sorted(owned)[size:]:
                a.free([x])
                owned.discard(x)
        src, dst = a.compaction(size)
        moves = dict(zip(src.tolist(), dst.tolist()))
        assert set(moves) <= owned and not set(moves.values()) & owned
        owned = {moves.get(x, x) for x in owned}
        a.resize(size, src, dst)
        assert a.num_slots == size and a.num_used == len(owned)
        assert all(x < size for x in owned)
        assert set(a.free_slots()) == set(range(size)) - owned
        rest = a.alloc(a.num_free)
        assert rest is not None and set(rest.tolist()) == set(range(size)) - owned
        a.free(rest)
        if owned:  # an owned slot is still owned: it frees once, a second free fails
            x = owned.pop()
            a.free([x])
            with pytest.raises(ValueError):
                a.free([x])
    assert a.compaction(a.num_slots)[0].numel() == 0  # nothing to move at the same size
