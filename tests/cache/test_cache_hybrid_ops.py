"""What HybridRadixCache decides besides its tree, on hand-built cases (the gaps the mutation run
of 2026-11-30 found, docs/testing.md): the state op each resume becomes, the session rule that
clears a superseded snapshot's resume bonus through every entry point that attaches one,
`drop_snapshot`, the `horizon` of the value rule, the loss reported in the match log line, and
the lost-snapshot memory forgotten with its node."""
from __future__ import annotations

import pytest
import torch

from freetoken.cache import HybridRadixCache, SlotAllocator, StatePool, create_policy
from freetoken.cache.snapshots import COPY, RESET, RESTORE

IDS = list(range(1, 40))


def _cache(states: int = 4, host: int = 0, horizon: int | None = None) -> HybridRadixCache:
    c = HybridRadixCache(SlotAllocator(512), StatePool(states), create_policy("semantic"),
                         StatePool(host) if host else None, horizon=horizon)
    c.insert(IDS, c.alloc_kv(len(IDS)))
    return c


def _ops(c: HybridRadixCache) -> list[tuple[str, int, int]]:
    return [(o.kind, o.src, o.dst) for o in c.take_ops()]


def _hits(c: HybridRadixCache) -> dict[int, int]:
    return {n.depth: s.hits for n, s in c._snaps.items()}


def _snap(c: HybridRadixCache, n: int, cls: str = "anchor", user: str | None = None) -> int:
    slot = c.alloc_state()
    assert slot is not None and c.insert_snapshot(IDS[:n], slot, cls, user)
    return slot


def test_load_state_becomes_one_op_per_tier() -> None:
    """Catches a resume loading the wrong state: none -> reset, device -> copy from the
    snapshot's slot, host -> restore (counted once per restore)."""
    c = _cache(states=3, host=1)
    work = c.alloc_state()
    c.load_state(c.match(IDS[:8]), work)
    assert _ops(c) == [(RESET, -1, work)]
    s10 = _snap(c, 10)
    m = c.match(IDS)
    assert (m.length, m.state_tier) == (10, "device")
    c.load_state(m, work)
    assert _ops(c) == [(COPY, s10, work)]
    fresh = c.alloc_state()
    c.copy_state(work, fresh)
    assert _ops(c) == [(COPY, work, fresh)]
    assert c.evict_states(1) == 1
    (spill,) = c.take_ops()
    for n in (1, 2):
        m = c.match(IDS)
        assert (m.length, m.state_tier, m.state_slot) == (10, "host", spill.dst)
        c.load_state(m, work)
        assert _ops(c) == [(RESTORE, spill.dst, work)]
        assert c.stats()["snapshots_restored"] == n


@pytest.mark.parametrize("how", ["attach", "insert", "release"])
@pytest.mark.parametrize("deeper_user,cleared", [("a", True), ("b", False), (None, False)])
def test_deeper_snapshot_of_the_same_session_clears_the_bonus(how: str, deeper_user: str | None,
                                                             cleared: bool) -> None:
    """A plain snapshot at 10 resumed by session `a` (hits 1) sits two tree nodes above the
    deeper one (a split at 15 between them). Only `a`'s own deeper snapshot clears its bonus,
    through each entry point that attaches one; catches the session being dropped on the way
    or the walk stopping at the first parent."""
    c = _cache()
    _snap(c, 10, "anchor")
    c.insert(IDS[:15] + [999], c.alloc_kv(16))  # splits the edge at 15: a node between
    m = c.match(IDS[:12], "a")
    assert (m.length, _hits(c)[10]) == (10, 1)
    if how == "insert":
        _snap(c, 20, "end", deeper_user)
    else:
        m = c.match(IDS[:21])
        c.lock(m.node)
        k = c.commit(IDS[:20], torch.cat([m.kv_slots, c.alloc_kv(20 - m.length)]), m.node,
                     m.length)
        slot = c.alloc_state()
        if how == "attach":
            assert c.attach_snapshot(k.node, slot, "end", deeper_user)
            c.unlock(k.node)
        else:
            assert c.release(IDS[:20], k.slots, k.node, 20, slot, "end",
                             deeper_user).snapshot_taken
    assert _hits(c)[10] == (0 if cleared else 1 if how == "insert" else 2)


@pytest.mark.parametrize("cls,cleared", [("interval", True), ("anchor", True), ("head", False)])
def test_only_plain_classes_lose_the_bonus(cls: str, cleared: bool) -> None:
    c = _cache()
    _snap(c, 10, cls)
    c.match(IDS[:12], "a")
    _snap(c, 20, "end", "a")
    assert _hits(c)[10] == (0 if cleared else 1)


def test_drop_snapshot_frees_its_slot_unless_pinned() -> None:
    c = _cache(states=2)
    s10, s20 = _snap(c, 10), _snap(c, 20)
    m = c.match(IDS)
    assert m.length == 20
    c.lock(m.node)
    with pytest.raises(ValueError, match="snapshot at 20 is pinned by a running request"):
        c.drop_snapshot(m.node)
    c.unlock(m.node)
    c.drop_snapshot(m.node)
    assert c.snapshots() == [(10, s10, "anchor")] and c.state_pool.is_free(s20)
    assert c.match(IDS).lost == "dropped:device@20"  # the default reason
    n10 = c.match(IDS[:12]).node
    c.drop_snapshot(n10, "per_sequence_cap")
    assert c.snapshots() == [] and c.stats()["snapshots_dropped"] == 2
    assert c.tiers.gone[n10] == "per_sequence_cap:device"


@pytest.mark.parametrize("horizon,kept", [(1000, "cut_point"), (None, "end")])
def test_horizon_sets_how_long_a_level_keeps_a_snapshot(horizon: int | None, kept: str) -> None:
    """A cut point (level 3) attached first, an end snapshot on another branch resumed 15
    times since. Horizon 1000: 3 levels outlast 15 ticks, the end goes. Default horizon
    (2 x 2 slots = 4): 12 ticks do not, the cut point goes. Catches `horizon` not reaching
    the value rule."""
    c = _cache(states=2, horizon=horizon)
    _snap(c, 10, "cut_point")
    other = [500 + i for i in range(12)]
    c.insert(other, c.alloc_kv(len(other)))
    slot = c.alloc_state()
    assert c.insert_snapshot(other[:8], slot, "end")
    for _ in range(15):
        assert c.match(other).length == 8
    c.state_pool.free([c.alloc_state()])  # the pool is full: one snapshot goes
    assert [cls for _, _, cls in c.snapshots()] == [kept]


def test_match_log_line_reports_the_lost_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    c = _cache(states=1)
    _snap(c, 20, "end")
    c.state_pool.free([c.alloc_state()])  # no host tier: the snapshot is dropped
    with caplog.at_level("DEBUG", logger="ft.cache"):
        m = c.match(IDS)
    assert m.lost == "device_full:device@20"
    line = ("match tokens=39 kv=38 state=0 reused=0 cls=None tier=None "
            "reason=no_snapshot_after=0 lost=device_full:device@20")
    assert [r.getMessage() for r in caplog.records if r.name == "ft.cache"] == [line]


def test_lost_snapshot_memory_goes_with_its_node() -> None:
    """`lost` is remembered per tree node; a node evicted from the tree must not keep its
    entry (memory growing with every evicted prefix)."""
    c = _cache(states=1)
    _snap(c, 20, "end")
    c.state_pool.free([c.alloc_state()])
    assert len(c.tiers.gone) == 1
    c.evict(10**6)
    assert c.tiers.gone == {}
