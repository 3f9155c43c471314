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


def test_renew_refreshes_named_heads_and_demotes_stale_cuts() -> None:
    """#23: a head or cut a request names again at or before where it resumed is refreshed
    (one tick) and raised; the session's own cut point it resumed past and does not name is a
    stale prediction and drops to `anchor`; another session's cut is left alone."""
    c = _cache(states=8)
    ids = list(range(1, 101))
    c.begin("a")
    _request(c, ids, [(20, "head"), (40, "cut_point"), (60, "cut_point")], "a")
    c.end("a")
    c.begin("b")
    _request(c, ids[:70] + [555] * 5, [(65, "cut_point")], "b")  # b resumes at a's 60
    c.end("b")
    snaps = {node.depth: s for node, s in c._snaps.items()}
    t20, t40 = snaps[20].last_access, snaps[40].last_access
    clock = c.tiers.clock
    m = c.match(ids + [7, 7], "a")  # a's next turn resumes at its end (103)
    c.begin("a", None, m)
    n = c.renew(ids + [7, 7], [(20, "cut_point"), (30, "head"), (60, "anchor")], m.length, "a")
    assert n == 1  # only 20 has a snapshot among the named heads / cuts
    assert (snaps[20].cls, snaps[20].last_access) == ("cut_point", clock + 2)  # match ticked
    assert snaps[20].last_access > t20
    assert snaps[40].cls == "anchor" and snaps[40].last_access == t40  # stale, not renewed
    assert snaps[60].cls == "cut_point"  # b resumed there: not a's alone
    c.end("a")


def test_a_finished_sub_agents_heads_and_cuts_keep_their_level() -> None:
    """#23: only a finished sub-agent's working snapshots (end, anchor, interval) drop to
    FINISHED; its heads and cut points keep their level (without a lineage term): the next
    sub-agent resumes at the shared head, a re-sent one at its cut."""
    from freetoken.cache.lineage import FINISHED

    for cls, want in (("end", FINISHED), ("anchor", FINISHED), ("head", 2),
                      ("cut_point", 3)):
        assert level(Snapshot(0, cls, 0), lineage=None) == want, cls
    shared = Snapshot(0, "head", 0, hits=1, users={"k1", "k2"})
    assert level(shared, lineage=None) == 2 + 1 + 2


def test_a_waiting_parents_latest_heads_and_cuts_do_not_age() -> None:
    """#23: while a parent waits on its sub-agents, its latest snapshot and its heads and cut
    points count as used now (`keep_until` from the current clock); its plain snapshots age."""
    c = _cache(states=16)
    head = list(range(1, 101))
    p1 = head + [200] * 20
    c.begin("p")
    _request(c, p1, [(50, "head"), (100, "cut_point"), (110, "anchor")], "p")
    c.end("p")
    c.begin("k", "p")  # a sub-agent starts (nothing in common): p waits on it
    _request(c, [5000 + i for i in range(30)], [], "k")
    h, now = c.tiers.horizon, c.tiers.clock
    snaps = {node.depth: s for node, s in c._snaps.items()}
    c.tiers._victims("device", set())  # refreshes which snapshots are covered
    key = {node.depth: c.tiers._key(node)[0] for node in c._snaps}
    assert all(snaps[d].last_access < now for d in (50, 100, 110, 123))
    assert key[50] == now + 2 * h  # a head: now
    assert key[100] == now + (3 + 3) * h  # its latest cut, BACK: now
    assert key[123] == now + (0 + 3) * h  # its latest (the end), BACK: now
    assert key[110] == snaps[110].last_access + (1 - 2) * h  # plain, covered: it ages
    c.end("k")
    c.begin("p")  # p is back: k finished, its snapshots age again
    assert c.tiers._key(next(n for n in c._snaps if n.depth == 50))[0] == \
        snaps[50].last_access + 2 * h


def test_a_sessions_latest_cut_gets_the_latest_bonus() -> None:
    """#23: Claude Code's sub-agent requests pre-open an empty `<think>` and the next request
    renders the reasoning there, so the session resumes at its latest request's deepest cut,
    not at its end: that cut gains LATEST like the end. The request before's cut does not."""
    from freetoken.cache.lineage import LATEST

    c = _cache(states=16)
    ids = list(range(1, 101))
    c.begin("s")
    _request(c, ids, [(60, "cut_point"), (96, "cut_point")], "s")
    c.end("s")
    by = {node.depth: node for node in c._snaps}
    assert c.lineage.bonus(by[96], c._snaps[by[96]].users) == LATEST
    assert c.lineage.bonus(by[60], c._snaps[by[60]].users) == 0
    assert c.lineage.bonus(by[103], c._snaps[by[103]].users) == LATEST  # the end, latest


def test_a_parent_is_inferred_from_prefix_structure_where_no_header_says() -> None:
    """#23 item 1, no header: a new session whose first prompt resumes from a snapshot another
    session made (its head, not its latest) is that session's sub-agent, and the parent's
    latest gains BACK while it runs; a new session resuming at another's latest continues it
    (not a sub-agent); an inferred sub-agent is never marked finished (an unrelated session of
    the same harness shares the same head). Bug it catches: lineage only from headers, so
    OpenClaw's and mini-swe-agent's sub-agents (no header) never kept their parent's state."""
    from freetoken.cache.lineage import BACK, LATEST

    c = _cache(states=16)
    head = list(range(1, 101))
    p1 = head + [200] * 20
    c.begin("p")
    _request(c, p1, [(100, "head")], "p")
    c.end("p")
    by = {node.depth: node for node in c._snaps}
    end = by[len(p1) + 3]
    assert c.lineage.bonus(end, c._snaps[end].users) == LATEST
    kid = head + [400] * 30
    m = c.match(kid, "k")
    assert m.length == 100  # resumes at p's head
    assert c.begin("k", None, m) == "p"
    assert not c.lineage.sessions["k"].declared and c.lineage.waiting_on_children("p")
    assert c.lineage.bonus(end, c._snaps[end].users) == BACK  # p will be back
    c.end("k")
    c.begin("p")
    c.end("p")
    assert not c.lineage.sessions["k"].finished  # inferred: never finished
    # a new session resuming at p's latest continues it: no parent
    m2 = c.match(p1 + [9000, 9001, 9002, 7, 7], "q")
    assert m2.node is end and c.begin("q", None, m2) is None
    # a session resuming nothing: no parent
    assert c.begin("r", None, c.match([7000 + i for i in range(30)], "r")) is None
