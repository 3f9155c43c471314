"""Deterministic hybrid-cache cases: reuse rule, exact repeat, snapshot classes and pins."""
from __future__ import annotations

import pytest
import torch

from freetoken.cache import HybridRadixCache, SlotAllocator, StatePool, create_policy


def _cache(kv: int = 64, states: int = 4) -> HybridRadixCache:
    return HybridRadixCache(SlotAllocator(kv), StatePool(states), create_policy("end_only"))


def _put(c: HybridRadixCache, ids: list[int]) -> None:
    own = c.alloc_kv(len(ids))
    assert own is not None
    p = c.insert(ids, own)
    c.radix.allocator.free(own[:p])


def _snap(c: HybridRadixCache, ids: list[int], cls: str = "anchor") -> int:
    slot = c.alloc_state()
    assert slot is not None
    assert c.insert_snapshot(ids, slot, cls)
    return slot


def test_reuse_is_capped_by_the_deepest_snapshot() -> None:
    c = _cache()
    ids = list(range(1, 21))
    _put(c, ids)
    s5, s12 = _snap(c, ids[:5]), _snap(c, ids[:12])
    _snap(c, ids[:18])
    m = c.match(ids[:15] + [99, 98])  # KV matches 15, snapshots at 5, 12 (18 is past the match)
    assert (m.length, m.kv_len, m.state_len, m.state_slot) == (12, 15, 12, s12)
    assert m.reason == "no_snapshot_after=12" and m.node.depth == 12
    assert m.kv_slots.tolist() == c.radix.match_prefix(ids[:12]).slots.tolist()
    m = c.match(ids[:11] + [0])
    assert (m.length, m.state_slot, m.reason) == (5, s5, "no_snapshot_after=5")
    m = c.match([7, 8])
    assert (m.length, m.state_slot, m.reason, m.node) == (0, -1, "kv_miss_at=0", c.radix.root)


def test_snapshot_splits_an_edge_and_uncached_prefix_is_refused() -> None:
    c = _cache()
    _put(c, [1, 2, 3, 4, 5, 6])
    slot = _snap(c, [1, 2, 3])
    assert c.snapshots() == [(3, slot, "anchor")]
    assert c.radix.root.children[1].key == [1, 2, 3]
    other = c.alloc_state()
    assert other is not None
    assert not c.insert_snapshot([1, 2, 3, 4, 5, 6, 7], other, "end")  # KV not cached
    assert not c.insert_snapshot([1, 2, 3], other, "cut_point")  # already there: class raised
    assert c.snapshots() == [(3, slot, "cut_point")]


def test_exact_repeat_recomputes_only_the_last_token() -> None:
    """Prefill of a prompt of length L snapshots at L-1 (end_only policy); a repeat reuses L-1."""
    c = _cache()
    prompt = [5, 6, 7, 8, 9, 10]
    assert c.policy.positions(len(prompt), []) == [(5, "end")]
    m = c.match(prompt)
    c.lock(m.node)
    row = c.alloc_kv(len(prompt))
    work = c.alloc_state()
    assert row is not None and work is not None
    # prefill chunk [0, 5): commit its KV, copy working -> fresh slot, attach at 5
    fresh = c.alloc_state()
    assert fresh is not None
    done = c.commit(prompt[:5], row[:5], m.node, 0)
    assert c.attach_snapshot(done.node, fresh, "end")
    # last prompt token + 3 generated tokens fed back: the request computed 9 tokens
    seq = prompt + [11, 12, 13]
    more = c.alloc_kv(3)
    assert more is not None
    rel = c.release(seq, torch.cat([done.slots, row[5:], more]), done.node, 5, state_slot=work)
    assert rel.snapshot_taken and rel.prefix_len == 5
    rep = c.match(prompt)
    assert (rep.length, rep.state_slot, rep.reason) == (5, fresh, "last_token")
    nxt = c.match(seq + [14, 15])  # the next turn extends the whole sequence
    assert (nxt.length, nxt.state_slot) == (9, work)
    assert c.match(seq).length == 5  # a repeat of the full sequence cannot use the state at 9


def test_state_eviction_follows_value() -> None:
    """The value rule of `freetoken.cache` (default horizon 8 ticks here): end 6 (covered,
    level -2) < anchor 4 (covered, resumed once: level 0) < anchor 8 (the deepest: level 1)
    < cut point 2 (level 3), although the anchor at 4 was used last."""
    c = _cache(states=4)
    ids = list(range(1, 11))
    _put(c, ids)
    cut = _snap(c, ids[:2], "cut_point")
    old_anchor = _snap(c, ids[:4], "anchor")
    end = _snap(c, ids[:6], "end")
    new_anchor = _snap(c, ids[:8], "anchor")
    c.match(ids[:5])  # touches the snapshot at 4: the anchor at 8 is now the older one
    assert c.alloc_state() == end  # pool full: the end class goes first
    assert c.evict_states(1) == 1 and [p for p, _, _ in c.snapshots()] == [2, 8]
    assert old_anchor not in [s for _, s, _ in c.snapshots()]
    assert c.evict_states(1) == 1 and c.snapshots() == [(2, cut, "cut_point")]
    assert c.evict_states(5) == 1 and c.snapshots() == []
    assert {cut, old_anchor, new_anchor} <= set(c.state_pool.free_slots())


def test_lock_pins_the_snapshot_at_the_matched_node() -> None:
    c = _cache(states=2)
    ids = [1, 2, 3, 4, 5, 6]
    _put(c, ids)
    low = _snap(c, ids[:2], "end")
    _snap(c, ids[:4], "end")
    m = c.match(ids)
    assert m.state_len == 4
    c.lock(m.node)
    assert c.evict_states(2) == 1 and c.snapshots() == [(4, m.state_slot, "end")]
    assert low in c.state_pool.free_slots()
    held = c.alloc_state()
    assert held is not None and c.alloc_state() is None  # the only other slot is pinned
    c.unlock(m.node)
    assert c.alloc_state() == m.state_slot


def test_kv_eviction_drops_the_nodes_snapshot() -> None:
    c = _cache(kv=8, states=3)
    _put(c, [1, 2, 3, 4])
    slot = _snap(c, [1, 2, 3, 4], "cut_point")
    assert c.evict(1) == 4
    assert c.snapshots() == [] and slot in c.state_pool.free_slots()
    assert c.stats()["snapshots_dropped"] == 1


def test_plain_model_reuses_kv_up_to_the_last_token() -> None:
    c = HybridRadixCache(SlotAllocator(16))
    _put(c, [1, 2, 3, 4])
    m = c.match([1, 2, 3, 4])
    assert (m.length, m.kv_len, m.state_slot, m.reason) == (3, 3, -1, "last_token")
    assert m.node.depth == 3  # split so the caller can lock exactly the reused prefix
    m = c.match([1, 2, 9, 9])
    assert (m.length, m.reason) == (2, "kv_miss_at=2")
    with pytest.raises(ValueError):
        c.alloc_state()
