"""Random operation sequences, every operation checked against the reference model."""
from __future__ import annotations

import pytest
from cache_driver import Driver


@pytest.mark.parametrize("mode", ["radix", "plain", "hybrid", "tiered"])
@pytest.mark.parametrize("seed", range(12))
def test_random_ops_match_reference(mode: str, seed: int) -> None:
    d = Driver(mode, seed)
    for _ in range(250):
        d.step()
    # drain: every request ends, then full eviction returns the pools to empty
    for r in list(d.reqs):
        d.abort(r)
    d.check()
    d.cache.evict(10**9)
    d.sync_eviction(10**9)
    d.check()
    assert d.alloc.num_free == d.alloc.num_slots and d.radix.total_size == 0
    if d.pool is not None:
        assert d.pool.num_free == d.pool.num_slots
    if d.host is not None:
        assert d.host.num_free == d.host.num_slots


@pytest.mark.parametrize("seed", range(12))
def test_random_lineage_ops_match_reference(seed: int) -> None:
    """One parent and two declared sub-agents: the lineage terms (a waiting parent's latest
    snapshot, finished sub-agents' snapshots) decide evictions, checked after every op."""
    d = Driver("tiered", seed, state_slots=6, host_slots=3)
    d.sessions = [("s1", None), ("k1", "s1"), ("k2", "s1")]
    for _ in range(250):
        d.step()
    for r in list(d.reqs):
        d.op_release(r)
    d.check()
