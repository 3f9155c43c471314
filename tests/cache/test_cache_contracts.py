"""The caches' contract besides their data: one exact log line per decision (users paste them
into issues, STYLE), the stats /v1/stats reports, and the errors of misuse. Every expected value
is worked by hand from the scripted operations (the comments show the working)."""
from __future__ import annotations

import re

import pytest
import torch

from freetoken.cache import HybridRadixCache, RadixCache, SlotAllocator, StatePool, create_policy


def _exact(message: str) -> str:
    """A `pytest.raises(match=...)` pattern for exactly `message` (match= only searches)."""
    return "^" + re.escape(message) + "$"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ft.cache"]


def test_radix_log_lines_and_stats(caplog: pytest.LogCaptureFixture) -> None:
    c = RadixCache(SlotAllocator(16))
    with caplog.at_level("DEBUG", logger="ft.cache"):
        own = c.alloc(5)
        assert c.insert([1, 2, 3, 4, 5], own) == 0
        assert c.match_prefix([1, 2, 3, 9]).length == 3  # splits [1..5] into [1,2,3] + [4,5]
        own = c.alloc(5)
        assert c.insert([1, 2, 3, 7, 8], own) == 3  # the tree keeps its own slots for 1,2,3
        c.allocator.free(own[:3])
        # leaves: [4,5] (last used by the first insert) and [7,8] (the second): [4,5] goes
        assert c.evict(2) == 2
        assert c.evict(0) == 0  # a no-op, and silent
    assert _lines(caplog) == [
        "insert tokens=5 cached=0 new=5",
        "match tokens=4 kv=3",
        "insert tokens=5 cached=3 new=2",
        "evict want=2 freed=2 nodes=1 left=5",
    ]
    assert c.stats() == {"kv_cached": 5, "kv_evictable": 5, "kv_protected": 0, "kv_free": 11,
                         "kv_slots": 16}
    m = c.match_prefix([1, 2, 3, 7])
    c.lock(m.node)  # 4 tokens on the locked path move from evictable to protected
    assert c.stats() == {"kv_cached": 5, "kv_evictable": 1, "kv_protected": 4, "kv_free": 11,
                         "kv_slots": 16}
    with pytest.raises(ValueError, match=_exact("insert: 2 ids but 1 slots")):
        c.insert([1, 2], torch.tensor([0]))
    with pytest.raises(ValueError, match=_exact("commit: node ends at 4, tree_len=3, ids=6")):
        c.commit([1, 2, 3, 7, 8, 9], torch.arange(6), m.node, 3)
    with pytest.raises(ValueError, match=_exact("commit: node ends at 4, tree_len=4, ids=3")):
        c.commit([1, 2, 3], torch.arange(3), m.node, 4)
    c.unlock(m.node)
    with pytest.raises(ValueError, match=r"^unlock of an unlocked node "):
        c.unlock(m.node)
    gone = c.match_prefix([1, 2, 3, 7, 8]).node
    c.evict(16)
    with pytest.raises(ValueError, match=r" is not in the tree \(evicted handle\)$"):
        c.path_to_root(gone)


def _hybrid(states: int = 3) -> HybridRadixCache:
    return HybridRadixCache(SlotAllocator(32), StatePool(states), create_policy("end_only"))


def test_hybrid_log_lines_counters_and_stats(caplog: pytest.LogCaptureFixture) -> None:
    c = _hybrid()
    ids = list(range(1, 11))
    own = c.alloc_kv(10)
    c.insert(ids, own)
    with caplog.at_level("DEBUG", logger="ft.cache"):
        s0 = c.alloc_state()  # the allocator hands out from the top: slot 2, then 1
        assert s0 == 2 and c.insert_snapshot(ids[:4], s0, "anchor")
        s1 = c.alloc_state()
        assert s1 == 1
        assert not c.insert_snapshot([1, 2, 99], s1, "anchor")  # KV covers only [1, 2]
        assert not c.insert_snapshot(ids[:4], s1, "cut_point")  # one there: raised, s1 kept
        m = c.match(ids)  # capped at 9 tokens; KV matches 9, the state only 4
        assert (m.length, m.kv_len, m.state_slot, m.state_class) == (4, 9, s0, "cut_point")
        assert c.evict_states(0) == 0 and c.snapshots() == [(4, s0, "cut_point")]
        assert c.evict_states(5) == 1  # one unpinned snapshot: freed, asked-for 5 or not
        assert c.insert_snapshot(ids[:6], s1, "end")
        assert c.match(ids[:7]).state_slot == s1  # a second hit, and a second match
        assert c.match([]).reason == "empty"
        assert c.evict(32) == 10  # the KV goes, and the snapshot on it with it
    assert _lines(caplog) == [
        "snapshot pos=4 slot=2 cls=anchor",
        "snapshot_skip pos=3 kv=2 why=prefix_not_cached",
        "snapshot_keep pos=4 slot=2 tier=device cls=cut_point",
        ("match tokens=10 kv=9 state=4 reused=4 cls=cut_point tier=device "
         "reason=no_snapshot_after=4 lost=None"),
        "snapshot_evict pos=4 slot=2 tier=device cls=cut_point why=device_full",
        "snapshot pos=6 slot=1 cls=end",
        "match tokens=7 kv=6 state=6 reused=6 cls=end tier=device reason=last_token lost=None",
        "match tokens=0 kv=0 state=0 reused=0 cls=None tier=None reason=empty lost=None",
        "snapshot_drop pos=6 slot=1 tier=device cls=end why=kv_evicted",
        "evict want=32 freed=10 nodes=3 left=0",
    ]
    assert c.stats() == {
        "kv_cached": 0, "kv_evictable": 0, "kv_protected": 0, "kv_free": 32, "kv_slots": 32,
        "matches": 3, "reused_tokens": 10, "snapshot_hits": 2, "snapshots_taken": 2,
        "snapshots_evicted": 1, "snapshots_dropped": 1, "snapshots_spilled": 0,
        "snapshots_restored": 0, "snapshots": 0, "snapshots_host": 0,
        "state_free": 3, "state_slots": 3,
    }


def test_hybrid_misuse_is_refused() -> None:
    kv_only = HybridRadixCache(SlotAllocator(8), None, create_policy("end_only"))
    assert not kv_only.has_state_pool and "state_free" not in kv_only.stats()
    assert HybridRadixCache(SlotAllocator(8)).policy.name == "semantic"  # the default policy
    assert _hybrid().policy.name == "end_only"  # a given one is kept
    assert kv_only.evict_states(3) == 0
    with pytest.raises(ValueError, match=_exact("alloc_state on a cache without a state pool")):
        kv_only.alloc_state()
    with pytest.raises(ValueError,
                       match=_exact("attach_snapshot on a cache without a state pool")):
        kv_only.attach_snapshot(kv_only.radix.root, 0, "end")
    c = _hybrid()
    s = c.alloc_state()
    with pytest.raises(ValueError, match=_exact(
            "a snapshot at position 0 is the zero state; nothing to attach")):
        c.attach_snapshot(c.radix.root, s, "end")
    c.insert([5, 6], c.alloc_kv(2))
    node = c.radix.match_prefix([5, 6]).node
    with pytest.raises(ValueError, match="state slot 0 is not allocated"):
        c.attach_snapshot(node, 0, "end")


def test_hybrid_counters_accumulate_and_empty_matches_index() -> None:
    """Counters add up over several events; an empty match's slots are int64 (they index the
    pool)."""
    c = _hybrid(states=4)
    m = c.match([4, 5, 6])  # nothing cached
    assert m.kv_slots.dtype == torch.long and m.kv_slots.numel() == 0
    ids = list(range(1, 9))
    c.insert(ids, c.alloc_kv(8))
    for n in (2, 4, 6):
        assert c.insert_snapshot(ids[:n], c.alloc_state(), "anchor")
    assert c.evict_states(2) == 2  # the two least recently taken: at 2 and 4
    assert [p for p, _, _ in c.snapshots()] == [6]
    assert c.insert_snapshot(ids[:3], c.alloc_state(), "anchor")
    assert c.evict(8) == 8  # drops the snapshots at 3 and 6 with their KV
    st = c.stats()
    assert (st["snapshots_taken"], st["snapshots_evicted"], st["snapshots_dropped"]) == (4, 2, 2)
    assert st["snapshots"] == 0 and st["state_free"] == 4


def test_room_without_drop_counts_free_device_slots_and_host_room() -> None:
    """`room_without_drop` (the kept-logits prompt-end snapshot's rule): a device slot is free,
    or the host tier has room for the device victim to spill into; never by a drop."""
    c = HybridRadixCache(SlotAllocator(32), StatePool(1), create_policy("end_only"))
    assert c.room_without_drop()
    slot = c.state_pool.alloc_one()
    assert slot is not None and not c.room_without_drop()  # full, no host tier
    h = HybridRadixCache(SlotAllocator(32), StatePool(1), create_policy("end_only"),
                         host_pool=StatePool(1))
    h.state_pool.alloc_one()
    assert h.room_without_drop()  # the victim would spill, not drop
    h.tiers.host.alloc_one()
    assert not h.room_without_drop()
    kv_only = HybridRadixCache(SlotAllocator(8), None, create_policy("end_only"))
    assert not kv_only.room_without_drop()
