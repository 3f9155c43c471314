"""Deterministic radix-tree cases: splitting, LRU order, locks, commit ownership."""
from __future__ import annotations

import random

import pytest
import torch

from freetoken.cache import RadixCache, SlotAllocator


def _t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


def _cache(n: int = 32) -> tuple[RadixCache, SlotAllocator]:
    a = SlotAllocator(n)
    return RadixCache(a), a


def _put(c: RadixCache, ids: list[int]) -> torch.Tensor:
    """Insert `ids` with fresh slots, freeing our duplicates; return the tree's slots."""
    own = c.alloc(len(ids))
    assert own is not None
    p = c.insert(ids, own)
    c.allocator.free(own[:p])
    return c.match_prefix(ids).slots


def test_match_inside_edge_splits_and_keeps_slots() -> None:
    c, a = _cache()
    slots = _put(c, [1, 2, 3, 4, 5])
    assert len(c.root.children) == 1 and len(c.root.children[1].key) == 5
    m = c.match_prefix([1, 2, 3, 9])
    assert m.length == 3 and m.slots.tolist() == slots[:3].tolist()
    assert m.node.depth == 3 and m.node.key == [1, 2, 3]
    (lower,) = m.node.children.values()
    assert lower.key == [4, 5] and lower.value.tolist() == slots[3:].tolist()
    assert c.total_size == 5 and a.num_used == 5  # a split moves no slot


def test_split_keeps_handle_identity_and_locks() -> None:
    c, _ = _cache()
    _put(c, [1, 2, 3, 4])
    m = c.match_prefix([1, 2, 3, 4])
    c.lock(m.node)
    c.match_prefix([1, 2, 7])  # splits the locked edge
    assert m.node.depth == 4 and m.node.key == [3, 4] and m.node.parent is not None
    assert m.node.parent.lock_ref == 1 and c.protected_size == 4 and c.evictable_size == 0
    assert c.evict(100) == 0
    c.unlock(m.node)
    assert c.evictable_size == 4 and c.evict(100) == 4


def test_insert_returns_cached_prefix_and_diverging_branch() -> None:
    c, a = _cache()
    _put(c, [1, 2, 3])
    own = c.alloc(5)
    assert own is not None
    assert c.insert([1, 2, 3, 4, 5], own) == 3
    c.allocator.free(own[:3])
    own2 = c.alloc(3)
    assert own2 is not None
    assert c.insert([1, 2, 8], own2) == 2  # diverges inside the edge [1, 2, 3]
    c.allocator.free(own2[:2])
    m = c.match_prefix([1, 2, 8])
    assert m.length == 3 and int(m.slots[2]) == int(own2[2])
    assert a.num_used == c.total_size == 6


def test_lru_evicts_oldest_leaf_first_and_exposes_parents() -> None:
    c, a = _cache()
    _put(c, [1, 1, 1])  # t1
    _put(c, [2, 2])  # t2
    _put(c, [1, 1, 1, 5, 5])  # t3: touches [1,1,1] too
    c.match_prefix([2, 2])  # t4: [2,2] is now the newest
    assert c.evict(1) == 2  # leaf [5,5] (t3) is older than [2,2] (t4); whole node goes
    assert c.match_prefix([1, 1, 1, 5]).length == 3
    # now [1,1,1] was touched by that match (t5): [2,2] (t4) is the oldest
    assert c.evict(1) == 2 and c.match_prefix([2, 2]).length == 0
    assert c.evict(0) == 0 and c.total_size == 3
    assert c.evict(10) == 3 and c.total_size == 0 and a.num_free == a.num_slots


def test_evict_stops_once_enough_is_freed() -> None:
    c, _ = _cache()
    _put(c, [1, 2])
    _put(c, [3, 4, 5])
    _put(c, [6])
    assert c.evict(2) == 2  # only the oldest leaf
    assert c.evict(3) == 3 and c.total_size == 1


def test_lock_refcounts_nest_and_unlock_underflow_raises() -> None:
    c, _ = _cache()
    _put(c, [1, 2, 3])
    m = c.match_prefix([1, 2])
    c.lock(m.node)
    c.lock(m.node)
    c.unlock(m.node)
    assert c.evict(10) == 1  # only [3] below the lock
    c.unlock(m.node)
    with pytest.raises(ValueError):
        c.unlock(m.node)
    assert c.evict(10) == 2
    with pytest.raises(ValueError):  # evicted handle
        c.lock(m.node)


def test_commit_frees_only_caller_duplicates() -> None:
    c, a = _cache()
    base = _put(c, [1, 2])
    m = c.match_prefix([1, 2, 3, 4, 5])
    c.lock(m.node)
    own = c.alloc(3)
    assert own is not None
    row = torch.cat([m.slots, own])
    _put(c, [1, 2, 3, 4])  # another request cached [3, 4] meanwhile
    used = a.num_used
    done = c.commit([1, 2, 3, 4, 5], row, m.node, 2)
    assert (done.prefix_len, done.freed) == (4, 2)
    assert a.num_used == used - 2  # own[0], own[1] were duplicates
    assert done.slots[:2].tolist() == base.tolist() and int(done.slots[4]) == int(own[2])
    assert done.node.lock_ref == 1 and m.node.lock_ref == 1  # m.node is on done.node's path
    c.unlock(done.node)
    assert c.protected_size == 0


def test_alloc_is_all_or_nothing() -> None:
    c, a = _cache(8)
    _put(c, [1, 2, 3, 4, 5])
    m = c.match_prefix([1, 2, 3])
    c.lock(m.node)
    assert c.alloc(7) is None  # 3 free + 2 evictable < 7
    assert a.num_free == 5  # it evicted what it could, allocated nothing
    got = c.alloc(5)
    assert got is not None and a.num_free == 0


def test_long_prompt_match_uses_the_mismatch_position() -> None:
    rng = random.Random(0)
    ids = [rng.randrange(50000) for _ in range(20000)]
    c, _ = _cache(40000)
    _put(c, ids)
    other = ids[:12345] + [-1] + ids[12346:]
    assert c.match_prefix(other).length == 12345
    assert c.match_prefix(ids + [7]).length == 20000
