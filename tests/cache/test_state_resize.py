"""Resizing the device state pool (cache/state_resize.py) inside random operation sequences,
every operation checked against the reference model (`cache_model.RefModel`, which writes the
snapshot eviction rule a second time): which snapshots leave on a shrink (the reference's own
`evict_device`: spilled or dropped by value), the spill ops, slot conservation after the
compaction (free + device snapshots + working states = every slot, each once), the tree's
content, locks and sizes — and the operations after the resize go on matching the reference
at the new size. Bugs caught: a shrink evicting by another rule than a full pool does, a
snapshot or working slot not relabelled (two owners of one slot, or a slot past the pool), a
pinned snapshot or a running request's state dropped, a refused resize that changed things."""
from __future__ import annotations

import pytest
from cache_driver import Driver

from freetoken.cache.state_resize import resize_device_states, state_resize_check


class ResizeDriver(Driver):
    """`Driver` with one more operation: resize the device state pool to a random size around
    what must stay (sometimes below it: refused)."""

    resizes = refused = shrinks = 0

    def op_resize_states(self) -> None:
        assert self.pool is not None
        working = [r.working for r in self.reqs if r.working is not None]
        locks = set(self.locks())
        pinned = sum(1 for p, v in self.ref.snaps.items()
                     if v["tier"] == "device" and p in locks)
        keep = len(working) + pinned
        n = self.rng.randint(max(1, keep - 1), keep + 5)
        old = self.pool.num_slots
        if n < keep:
            assert state_resize_check(self.cache, n, working) is not None
            with pytest.raises(ValueError):
                resize_device_states(self.cache, n, working)
            assert self.pool.num_slots == old and not self.cache.take_ops()
            self.refused += 1
            return
        over = self.pool.num_used - n
        moves = self.ref.evict_device(locks, max(over, 0))
        res = resize_device_states(self.cache, n, working)
        spilled = [m for m in moves if m[2] == "spill"]
        assert [(o.kind, o.src) for o in res.ops] == [("spill", s) for _, s, _ in spilled]
        assert (res.spilled, res.dropped) == (len(spilled), len(moves) - len(spilled))
        host_of = {p: s.slot for p, s in self._snaps_by_prefix().items()}
        for o, (p, _, _) in zip(res.ops, spilled):
            assert p not in self.ref.snaps or host_of[p] == o.dst, "spill to the wrong host slot"
        src, dst = res.src.tolist(), res.dst.tolist()
        assert all(s >= n for s in src) and all(d < n for d in dst) and len(set(dst)) == len(dst)
        for v in self.ref.snaps.values():
            if v["tier"] == "device":
                v["slot"] = res.relabel(v["slot"])
        for r in self.reqs:
            if r.working is not None:
                r.working = res.relabel(r.working)
        assert self.pool.num_slots == n
        self.resizes += 1
        self.shrinks += n < old

    def _snaps_by_prefix(self) -> dict:
        from cache_model import node_prefix

        return {node_prefix(x): s for x, s in self.cache._snaps.items()}

    def step(self) -> None:
        if self.rng.random() < 0.12:
            self.op_resize_states()
            self.check()
        else:
            super().step()


@pytest.mark.parametrize("mode", ["hybrid", "tiered"])
@pytest.mark.parametrize("seed", range(10))
def test_random_resizes_match_reference(mode: str, seed: int) -> None:
    d = ResizeDriver(mode, seed, state_slots=6, host_slots=3)
    for _ in range(250):
        d.step()
    assert d.resizes >= 5 and d.shrinks >= 1
    for r in list(d.reqs):
        d.abort(r)
    d.check()
    d.cache.evict(10**9)
    d.sync_eviction(10**9)
    d.check()
    assert d.pool.num_free == d.pool.num_slots


def test_a_resize_of_a_cache_without_state_is_refused() -> None:
    from freetoken.cache import HybridRadixCache, SlotAllocator

    cache = HybridRadixCache(SlotAllocator(8))
    assert state_resize_check(cache, 4, []) == "the model has no recurrent state"
    with pytest.raises(ValueError):
        resize_device_states(cache, 4, [])
