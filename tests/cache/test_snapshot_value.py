"""Value-based snapshot eviction and the host tier, on hand-built cases whose answer is worked
out in the comments (the random reference-model test covers arbitrary sequences)."""
from __future__ import annotations

import torch

from freetoken.cache import HybridRadixCache, SlotAllocator, StatePool, create_policy
from freetoken.cache.snapshots import Snapshot, keep_until, level


def _cache(states: int, host: int = 0, horizon: int | None = None) -> HybridRadixCache:
    return HybridRadixCache(SlotAllocator(4096), StatePool(states), create_policy("semantic"),
                            StatePool(host) if host else None, horizon=horizon)


def _request(c: HybridRadixCache, ids: list[int], snaps: list[tuple[int, str]], user: str,
             gen: int = 3) -> int:
    """What the scheduler does for one request: match, snapshots at `snaps`, donate the end.
    Returns the reused length."""
    m = c.match(ids, user)
    c.lock(m.node)
    full = ids + [9000 + i for i in range(gen)]
    row = torch.cat([m.kv_slots, c.alloc_kv(len(full) - m.length)])
    work = c.alloc_state()
    assert work is not None
    c.load_state(m, work)
    node, tree_len = m.node, m.length
    for p, cls in snaps:
        if p <= m.length:
            continue
        fresh = c.alloc_state()
        assert fresh is not None
        c.copy_state(work, fresh)
        k = c.commit(ids[:p], row[:p], node, tree_len)
        row, node, tree_len = torch.cat([k.slots, row[p:]]), k.node, p
        if not c.attach_snapshot(k.node, fresh, cls, user):
            c.state_pool.free([fresh])
    if not c.release(full, row, node, tree_len, work, "end", user).snapshot_taken:
        c.state_pool.free([work])
    c.take_ops()
    return m.length


def test_level_terms() -> None:
    s = Snapshot(0, "head", last_access=10)
    assert level(s) == 2 and keep_until(s, 100) == 210
    s.hits = 1
    assert level(s) == 3
    s.users = {"a", "b"}
    assert level(s) == 5 and keep_until(s, 100) == 510
    assert level(Snapshot(0, "end", 0)) == 0 and level(Snapshot(0, "cut_point", 0)) == 3


def test_shared_head_outlives_every_sessions_working_snapshots() -> None:
    """Bug caught: under LRU the system + tools snapshot two sessions shared, untouched while
    they work from their own turn snapshots, was the first victim, so the next session or
    sub-agent recomputed the whole head."""
    head = list(range(1, 201))  # system + tools
    c = _cache(states=6)
    sessions = {f"s{i}": head + [1000 * (i + 1) + t for t in range(50)] for i in range(2)}
    for turn in range(8):
        for user, ids in sessions.items():
            ids += [7 + turn, 8 + turn]  # the session's next turn appends
            reused = _request(c, ids, [(200, "head"), (len(ids) - 2, "anchor")], user)
            assert turn == 0 or reused >= len(ids) - 5  # resumes from its own last turn
            ids += [9000, 9001, 9002]  # the harness sends the model's answer back
    assert c.stats()["snapshots_evicted"] >= 10  # the pool really was under pressure
    m = c.match(head + [5, 5, 5], "s2")  # a new session (or sub-agent) with the same head
    assert (m.length, m.state_class) == (200, "head")


def test_device_victim_spills_to_host_and_a_match_restores_it() -> None:
    c = _cache(states=2, host=2)
    a = list(range(1, 40))
    _request(c, a, [(20, "anchor")], "a")  # snapshots at 20 and 42 (end), both device slots
    b = list(range(100, 140))
    m = c.match(b, "b")
    c.lock(m.node)
    # pool full: the lower-value snapshot moves to the host: the anchor at 20, covered by the
    # end at 42 below it (an appending session resumes from its deepest)
    w = c.alloc_state()
    ops = c.take_ops()
    assert [o.kind for o in ops] == ["spill"] and c.stats()["snapshots_host"] == 1
    c.state_pool.free([w])
    c.unlock(m.node)
    assert c.match(a + [9000, 9001, 9002, 55]).state_tier == "device"  # the end, at 42
    m = c.match(a[:25] + [77])  # an edit after the anchor resumes at the host snapshot (20)
    assert (m.length, m.state_tier, m.state_slot) == (20, "host", ops[0].dst)
    c.lock(m.node)
    work = c.alloc_state()
    c.load_state(m, work)
    assert [(o.kind, o.src, o.dst) for o in c.take_ops()] == [("restore", ops[0].dst, work)]
    c.unlock(m.node)


def test_host_full_drops_the_lower_value_and_reports_the_loss() -> None:
    c = _cache(states=1, host=1, horizon=1000)
    _request(c, list(range(1, 30)), [], "a")  # end snapshot at 32 (level 0)
    w = c.alloc_state()  # -> host
    c.state_pool.free([w])
    assert c.insert_snapshot(list(range(1, 21)), c.alloc_state(), "cut_point")
    # device: cut point at 20 (level 3); host: the end at 32 (level 0)
    w = c.alloc_state()  # the cut point is worth more than the host's end snapshot: replaces it
    assert c.snapshots() == [(20, 0, "cut_point")] and c.stats()["snapshots_evicted"] == 1
    c.state_pool.free([w])
    m = c.match(list(range(1, 30)) + [9000, 9001, 9002, 77])
    assert m.length == 20 and m.state_tier == "host" and m.lost == "host_full:host@32"
