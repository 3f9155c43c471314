"""Hybrid radix cache: attention KV for any prefix, recurrent state only at snapshots.

A snapshot is a state-pool slot attached to a radix node: it holds the linear-attention state
(conv + ssm, every linear layer) covering exactly `[0, node.depth)`. Linear layers can only
resume from a snapshot, so for a hybrid model the reusable prefix of `ids` is

    usable = deepest snapshot position s with s <= min(KV match of ids, len(ids) - 1)

(0 with a zero state when there is none); for a model without linear layers (`state_pool=None`)
usable = min(KV match, len(ids) - 1). The `len(ids) - 1` cap exists because the caller must
feed at least the last prompt token to get logits. An exact repeat of a cached prompt of
length L therefore resumes at L-1 only if a snapshot sits at L-1: every policy places an
`end` snapshot there during prefill (see `policy.py`), so the repeat recomputes one token.

Ownership of state slots: `alloc_state` hands a slot to the caller (a running request's
working state, or the target of a mid-prefill copy). `attach_snapshot`/`insert_snapshot`
return True when the cache took the slot, False when the caller still owns it (prefix not
cached, or a snapshot already sits there: same tokens, same state) and must free or reuse it.
Snapshots are freed by `evict_states` (lowest class first, LRU within a class) and when KV
eviction removes their node. `lock(node)` also pins the snapshot at exactly `node`, so the
`state_slot` of a match stays valid while its node is locked (copy it into the working slot,
then the first `commit` moves the lock and the pin on).

Scheduler flow for one request (`RadixCache`'s module docstring has the KV side):
`m = match(ids)`; `lock(m.node)`; `row = cat(m.kv_slots, alloc_kv(len(ids) - m.length))`;
`work = alloc_state()`; the engine loads `m.state_slot` into `work` (zeros if -1). For each
policy position `p > m.length` (`policy.positions(len(ids), anchors)`): prefill up to `p`,
`fresh = alloc_state()`, the engine copies `work -> fresh`, `c = commit(ids[:p], row[:p], node,
tree_len)`, `attach_snapshot(c.node, fresh, cls)` (free `fresh` if False). At finish:
`release(seq, row, node, tree_len, state_slot=work)` (free `work` if not taken).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from freetoken.cache.allocator import SlotAllocator
from freetoken.cache.node import TreeNode, as_ids
from freetoken.cache.policy import END, CheckpointPolicy, class_rank, create_policy
from freetoken.cache.radix import Committed, RadixCache
from freetoken.cache.state_pool import StatePool
from freetoken.log import get_logger, kv

log = get_logger("cache")


@dataclass
class Snapshot:
    slot: int
    cls: str
    last_access: int


class HybridMatch(NamedTuple):
    """Reuse decision for one prompt.

    `length`: tokens `[0, length)` need no recompute; `kv_slots` (`[length]`, tree-owned) are
    their KV; `node` ends at `length` (lock it). `kv_len`: raw KV match of `ids[:len-1]`.
    `state_len`/`state_slot`/`state_class`: the snapshot resumed from (`state_len == length`,
    slot -1 and class None when none: start from a zero state; always so without a state pool).
    `reason`: why no longer reuse: `last_token` (capped at len-1), `no_snapshot_after=S` (KV
    matched further but no snapshot past S), `kv_miss_at=K` (the KV prefix diverges at K).
    """

    length: int
    kv_len: int
    state_len: int
    state_slot: int
    node: TreeNode
    kv_slots: torch.Tensor  # [length]
    reason: str
    state_class: str | None


class Released(NamedTuple):
    prefix_len: int
    snapshot_taken: bool


class HybridRadixCache:
    """Radix KV cache plus recurrent-state snapshots on its nodes (see the module docstring)."""

    def __init__(self, kv_allocator: SlotAllocator, state_pool: StatePool | None = None,
                 policy: CheckpointPolicy | None = None) -> None:
        self.radix = RadixCache(kv_allocator, on_evict=self._on_kv_evict)
        self.state_pool = state_pool
        self.policy = policy if policy is not None else create_policy("semantic")
        self._snaps: dict[TreeNode, Snapshot] = {}
        self._pins: dict[TreeNode, int] = {}
        self._sclock = 0
        self.counters = {"matches": 0, "reused_tokens": 0, "snapshot_hits": 0,
                         "snapshots_taken": 0, "snapshots_evicted": 0, "snapshots_dropped": 0}

    @property
    def is_hybrid(self) -> bool:
        return self.state_pool is not None

    @property
    def evictable_size(self) -> int:
        return self.radix.evictable_size

    @property
    def protected_size(self) -> int:
        return self.radix.protected_size

    @property
    def total_size(self) -> int:
        return self.radix.total_size

    @property
    def num_snapshots(self) -> int:
        return len(self._snaps)

    def _tick(self) -> int:
        self._sclock += 1
        return self._sclock

    # -- lookup -------------------------------------------------------------------------------

    def match(self, ids: Sequence[int] | torch.Tensor) -> HybridMatch:
        """Longest reusable prefix of `ids` under the rule in the module docstring. Marks the
        used path and snapshot recently used. Nothing is locked: lock `node` before anything
        can evict (allocations, inserts of other requests)."""
        key = as_ids(ids)
        cap = max(len(key) - 1, 0)
        if not self.is_hybrid:
            m = self.radix.lookup(key[:cap])
            kv_len = length = m.length
            state_len, node, slots, slot, cls = 0, m.node, m.slots, -1, None
        else:
            path, n, _, k = self.radix.walk(key[:cap])
            kv_len = n + k
            i = len(path) - 1
            while i >= 0 and path[i] not in self._snaps:
                i -= 1
            use = path[: i + 1]
            self.radix.touch(use)
            node = use[-1] if use else self.radix.root
            length = state_len = node.depth
            slots = torch.cat([x.value for x in use]) if use else torch.empty(0, dtype=torch.long)
            snap = self._snaps.get(node)
            slot, cls = (-1, None) if snap is None else (snap.slot, snap.cls)
            if snap is not None:
                snap.last_access = self._tick()
                self.counters["snapshot_hits"] += 1
        if len(key) == 0:
            reason = "empty"
        elif length == cap:
            reason = "last_token"
        elif length < kv_len:
            reason = f"no_snapshot_after={length}"
        else:
            reason = f"kv_miss_at={kv_len}"
        self.counters["matches"] += 1
        self.counters["reused_tokens"] += length
        log.debug(kv("match", tokens=len(key), kv=kv_len, state=state_len, reused=length,
                     cls=cls, reason=reason))
        return HybridMatch(length, kv_len, state_len, slot, node, slots, reason, cls)

    # -- locks and KV -------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Lock `node`'s path against KV eviction and pin the snapshot at `node` (if any)."""
        self.radix.lock(node)
        self._pins[node] = self._pins.get(node, 0) + 1

    def unlock(self, node: TreeNode) -> None:
        self.radix.unlock(node)
        left = self._pins[node] - 1
        if left:
            self._pins[node] = left
        else:
            del self._pins[node]

    def insert(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor) -> int:
        """`RadixCache.insert`: same return value and slot ownership."""
        return self.radix.insert(ids, slots)

    def commit(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor, node: TreeNode,
               tree_len: int) -> Committed:
        """`RadixCache.commit` (same contract); the snapshot pin moves with the lock."""
        c = self.radix.commit(ids, slots, node, tree_len)
        self._pins[c.node] = self._pins.get(c.node, 0) + 1
        left = self._pins[node] - 1
        if left:
            self._pins[node] = left
        else:
            del self._pins[node]
        return c

    def release(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor, node: TreeNode,
                tree_len: int, state_slot: int | None = None, state_class: str = END) -> Released:
        """Finish a request: commit its KV, donate `state_slot` (its final state, covering
        `[0, len(ids))`) as a snapshot if given, unlock. If `snapshot_taken` is False the
        caller still owns `state_slot`."""
        c = self.commit(ids, slots, node, tree_len)
        taken = (state_slot is not None and c.node is not self.radix.root
                 and self.attach_snapshot(c.node, state_slot, state_class))
        self.unlock(c.node)
        return Released(c.prefix_len, taken)

    def alloc_kv(self, n: int) -> torch.Tensor | None:
        """`RadixCache.alloc`: `n` caller-owned KV slots or None (may evict LRU KV leaves)."""
        return self.radix.alloc(n)

    def evict(self, num_tokens: int) -> int:
        """KV eviction (`RadixCache.evict`); evicted nodes drop their snapshots."""
        return self.radix.evict(num_tokens)

    def _on_kv_evict(self, node: TreeNode) -> None:
        snap = self._snaps.pop(node, None)
        if snap is not None:
            assert self.state_pool is not None
            self.state_pool.free([snap.slot])
            self.counters["snapshots_dropped"] += 1
            log.debug(kv("snapshot_drop", pos=node.depth, slot=snap.slot, cls=snap.cls,
                         why="kv_evicted"))

    # -- snapshots ----------------------------------------------------------------------------

    def alloc_state(self) -> int | None:
        """One caller-owned state slot, evicting one snapshot if the pool is full; None when
        every slot is a working state or a pinned snapshot."""
        if self.state_pool is None:
            raise ValueError("alloc_state on a cache without a state pool")
        if self.state_pool.num_free == 0:
            self.evict_states(1)
        return self.state_pool.alloc_one()

    def attach_snapshot(self, node: TreeNode, state_slot: int, cls: str) -> bool:
        """Attach `state_slot` (the state covering `[0, node.depth)`) at `node`, which must be
        in the tree (e.g. the locked node from `commit`). True: the cache owns the slot now.
        False: a snapshot already sits there (its class is raised to `cls` if higher); the
        caller keeps `state_slot`."""
        if self.state_pool is None:
            raise ValueError("attach_snapshot on a cache without a state pool")
        rank = class_rank(cls)
        if node is self.radix.root:
            raise ValueError("a snapshot at position 0 is the zero state; nothing to attach")
        self.radix.path_to_root(node)  # raises on a detached (evicted) handle
        if self.state_pool.is_free(state_slot):
            raise ValueError(f"state slot {state_slot} is not allocated")
        old = self._snaps.get(node)
        if old is not None:
            if rank > class_rank(old.cls):
                old.cls = cls
            old.last_access = self._tick()
            log.debug(kv("snapshot_keep", pos=node.depth, slot=old.slot, cls=old.cls))
            return False
        self._snaps[node] = Snapshot(state_slot, cls, self._tick())
        self.counters["snapshots_taken"] += 1
        log.debug(kv("snapshot", pos=node.depth, slot=state_slot, cls=cls))
        return True

    def insert_snapshot(self, ids_prefix: Sequence[int] | torch.Tensor, state_slot: int,
                        cls: str) -> bool:
        """`attach_snapshot` at the node ending exactly at `len(ids_prefix)` (splitting an edge
        if needed). False without taking the slot if `ids_prefix`'s KV is not fully cached."""
        key = as_ids(ids_prefix)
        path, n, partial, k = self.radix.walk(key)
        if n + k < len(key) or not key:
            log.debug(kv("snapshot_skip", pos=len(key), kv=n + k, why="prefix_not_cached"))
            return False
        node = path[-1] if partial is None else self.radix.split(partial, k)
        return self.attach_snapshot(node, state_slot, cls)

    def evict_states(self, n: int) -> int:
        """Free up to `n` unpinned snapshots: lowest class first, least recently used within a
        class. Returns how many were freed. `evict_states(0)` is a no-op."""
        if n <= 0 or self.state_pool is None:
            return 0
        cands = sorted((class_rank(s.cls), s.last_access, node.uid, node)
                       for node, s in self._snaps.items() if node not in self._pins)
        for _, _, _, node in cands[:n]:
            snap = self._snaps.pop(node)
            self.state_pool.free([snap.slot])
            self.counters["snapshots_evicted"] += 1
            log.debug(kv("snapshot_evict", pos=node.depth, slot=snap.slot, cls=snap.cls))
        return min(n, len(cands))

    def snapshots(self) -> list[tuple[int, int, str]]:
        """`(position, slot, class)` of every snapshot, by position (for stats and tests)."""
        return sorted((node.depth, s.slot, s.cls) for node, s in self._snaps.items())

    def stats(self) -> dict[str, int]:
        out = dict(self.radix.stats(), **self.counters, snapshots=len(self._snaps))
        if self.state_pool is not None:
            out["state_free"] = self.state_pool.num_free
            out["state_slots"] = self.state_pool.num_slots
        return out
