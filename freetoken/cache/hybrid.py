"""Hybrid-state radix cache: attention KV for any prefix, recurrent state only at snapshots.

A snapshot is a state-pool slot attached to a radix node: it holds the linear-attention state
(conv + ssm, every linear layer) covering exactly `[0, node.depth)`. How much of a prompt a
match reuses (the deepest snapshot within the KV match, the `len - 1` cap, kept logits) is the
rule in `reuse.py`; this class owns the tree, the snapshot tiers, the kept logits and the pins,
and keeps them consistent.

Ownership of state slots: `alloc_state` hands a slot to the caller (a running request's
working state, or the target of a mid-prefill copy). `attach_snapshot`/`insert_snapshot`
return True when the cache took the slot, False when the caller still owns it (prefix not
cached, or a snapshot already sits there: same tokens, same state) and must free or reuse it.
Snapshots live in two tiers (`tiers.py`): when the device pool is short, `evict_states` and
`alloc_state` move the lowest-value snapshot to the host pool (a `spill` op) or drop it (no host
room worth taking); KV eviction of a node drops its snapshot in either tier. A match resumes from
the deepest snapshot of either tier; `load_state` turns it into one op for the engine (device:
`copy`, host: `restore`, none: `reset`). Every decided state movement waits in `ops` until the
scheduler hands it to the engine (`take_ops`). `lock(node)` also pins the snapshot at exactly
`node`, so the `state_slot` of a match stays valid while its node is locked (load it into the
working slot, then the first `commit` moves the lock and the pin on).

Scheduler flow for one request (`RadixCache`'s module docstring has the KV side):
`m = match(ids)`; `lock(m.node)`; `row = cat(m.kv_slots, alloc_kv(len(ids) - m.length))`;
`work = alloc_state()`; `load_state(m, work)`. For each policy position `p > m.length`
(`policy.positions(len(ids), anchors)`): prefill up to `p`, `fresh = alloc_state()`,
`copy_state(work, fresh)`, `c = commit(ids[:p], row[:p], node, tree_len)`,
`attach_snapshot(c.node, fresh, cls)` (free `fresh` if False). At finish:
`release(seq, row, node, tree_len, state_slot=work)` (free `work` if not taken).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from freetoken.cache.allocator import SlotAllocator
from freetoken.cache.lineage import Lineage
from freetoken.cache.logits import KeptLogits
from freetoken.cache.node import Pins, TreeNode, as_ids
from freetoken.cache.policy import (
    ANCHOR,
    CUT_POINT,
    END,
    HEAD,
    CheckpointPolicy,
    class_rank,
    create_policy,
)
from freetoken.cache.radix import Committed, RadixCache
from freetoken.cache.reuse import HybridMatch, find_reuse
from freetoken.cache.snapshots import COPY, DEVICE, HOST, RESET, RESTORE, Snapshot, StateOp
from freetoken.cache.state_pool import StatePool
from freetoken.cache.tiers import SnapshotTiers
from freetoken.log import get_logger, kv

log = get_logger("cache")


class Released(NamedTuple):
    prefix_len: int
    snapshot_taken: bool


class HybridRadixCache:
    """Radix KV cache plus recurrent-state snapshots on its nodes (see the module docstring).

    `host_pool`: the host tier's slots (None: no host tier). `eviction`: `value` (default, the
    rule in `snapshots.py`) or `lru`. `horizon`: ticks one value level is worth (default twice
    the device + host slots). `logits_slots`: kept logits rows (`logits.py`; 0: none)."""

    def __init__(self, kv_allocator: SlotAllocator, state_pool: StatePool | None = None,
                 policy: CheckpointPolicy | None = None, host_pool: StatePool | None = None,
                 eviction: str = "value", horizon: int | None = None,
                 logits_slots: int = 0) -> None:
        self.radix = RadixCache(kv_allocator, on_evict=self._on_kv_evict)
        self.state_pool = state_pool
        self.host_pool = host_pool
        self.policy = policy if policy is not None else create_policy("semantic")
        self.lineage = Lineage()
        self.tiers = SnapshotTiers(state_pool if state_pool is not None else StatePool(0),
                                   host_pool, eviction, horizon, lambda n: n.depth,
                                   lambda n: n.parent, self.lineage)
        self.logits = KeptLogits(logits_slots if state_pool is not None else 0)
        self.tiers.on_drop = self.logits.drop
        self._pins = Pins()  # nodes locked by running requests: their snapshots stay
        self.counters = {"matches": 0, "reused_tokens": 0, "snapshot_hits": 0}

    @property
    def _snaps(self) -> dict[TreeNode, Snapshot]:
        return self.tiers.snaps

    @property
    def has_state_pool(self) -> bool:
        """The model has linear-attention layers: snapshots of their state are kept."""
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

    def take_ops(self) -> list[StateOp]:
        """The state movements decided since the last call, in the order to carry them out."""
        ops, self.tiers.ops = self.tiers.ops, []
        return ops

    # -- lookup -------------------------------------------------------------------------------

    def match(self, ids: Sequence[int] | torch.Tensor, user: str | None = None) -> HybridMatch:
        """Longest reusable prefix of `ids` (`reuse.py`'s rule). Marks the used path and
        snapshot recently used, counts the resume (and `user`, the session) on the snapshot.
        Nothing is locked: lock `node` before anything can evict."""
        key = as_ids(ids)
        m = find_reuse(self.radix, self.tiers if self.has_state_pool else None, self.logits,
                       key, user)
        self.counters["matches"] += 1
        self.counters["reused_tokens"] += m.length
        self.counters["snapshot_hits"] += m.state_tier is not None
        log.debug(kv("match", tokens=len(key), kv=m.kv_len, state=m.state_len, reused=m.length,
                     cls=m.state_class, tier=m.state_tier, reason=m.reason,
                     lost=m.lost or None))
        return m

    def alloc_logits(self) -> int | None:
        """A caller-owned kept-logits slot (`logits.py`), or None (none configured, or every
        row is at a locked node). Attach it with `attach_logits` once the engine wrote it."""
        return self.logits.alloc(self._pins)

    def attach_logits(self, node: TreeNode, slot: int) -> bool:
        """Keep the logits row `slot` at `node`, which must hold a snapshot (the state the row
        was computed with). False: not taken (no snapshot there, or a row is already kept);
        the caller frees `slot` (`free_logits`)."""
        if node not in self._snaps:
            return False
        return self.logits.attach(node, slot)

    def free_logits(self, slot: int) -> None:
        self.logits.free(slot)

    def load_state(self, m: HybridMatch, work: int) -> None:
        """Queue the op that puts `m`'s resume state into the device slot `work`. Call while
        `m.node` is locked (the lock pins the snapshot until the op has run)."""
        if m.state_tier == HOST:
            self.tiers.ops.append(StateOp(RESTORE, m.state_slot, work))
            self.tiers.counters["snapshots_restored"] += 1
        elif m.state_tier == DEVICE:
            self.tiers.ops.append(StateOp(COPY, m.state_slot, work))
        else:
            self.tiers.ops.append(StateOp(RESET, -1, work))

    def copy_state(self, src: int, dst: int) -> None:
        """Queue a device copy `src -> dst` (a mid-prefill snapshot of a working state)."""
        self.tiers.ops.append(StateOp(COPY, src, dst))

    def begin(self, session: str, parent: str | None = None,
              m: HybridMatch | None = None) -> str | None:
        """A request of `session` starts (`lineage.py`): `parent` the parent key its harness
        sent, `m` its prompt's match (a new session without a parent key that resumed from
        another session's snapshot is that session's sub-agent). Returns the parent session.
        Call once per request, before its first `attach_snapshot`; `end` when it is done."""
        users: set[str] = set()
        if m is not None and m.state_len > 0:
            snap = self._snaps.get(m.node)
            users = set(snap.users) if snap is not None else set()
        return self.lineage.begin(session, parent, users, m.node if m is not None else None
                                  ).parent

    def end(self, session: str) -> None:
        """The request `begin` counted is done (finished, aborted or preempted)."""
        self.lineage.end(session)

    # -- locks and KV -------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Lock `node`'s path against KV eviction and pin the snapshot at `node` (if any)."""
        self.radix.lock(node)
        self._pins.add(node)

    def unlock(self, node: TreeNode) -> None:
        self.radix.unlock(node)
        self._pins.remove(node)

    def insert(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor) -> int:
        """`RadixCache.insert`: same return value and slot ownership."""
        return self.radix.insert(ids, slots)

    def commit(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor, node: TreeNode,
               tree_len: int) -> Committed:
        """`RadixCache.commit` (same contract); the snapshot pin moves with the lock."""
        c = self.radix.commit(ids, slots, node, tree_len)
        self._pins.add(c.node)
        self._pins.remove(node)
        return c

    def release(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor, node: TreeNode,
                tree_len: int, state_slot: int | None = None, state_class: str = END,
                user: str | None = None) -> Released:
        """Finish a request: commit its KV, donate `state_slot` (its final state, covering
        `[0, len(ids))`) as a snapshot if given, unlock. If `snapshot_taken` is False the
        caller still owns `state_slot`."""
        c = self.commit(ids, slots, node, tree_len)
        taken = (state_slot is not None and c.node is not self.radix.root
                 and self.attach_snapshot(c.node, state_slot, state_class, user))
        self.unlock(c.node)
        return Released(c.prefix_len, taken)

    def alloc_kv(self, n: int) -> torch.Tensor | None:
        """`RadixCache.alloc`: `n` caller-owned KV slots or None (may evict LRU KV leaves)."""
        return self.radix.alloc(n)

    def evict(self, num_tokens: int) -> int:
        """KV eviction (`RadixCache.evict`); evicted nodes drop their snapshots (both tiers)."""
        return self.radix.evict(num_tokens)

    def _on_kv_evict(self, node: TreeNode) -> None:
        if node in self._snaps:
            self.tiers.drop(node, "kv_evicted")
        self.logits.drop(node)
        self.tiers.forget(node)

    # -- snapshots ----------------------------------------------------------------------------

    def alloc_state(self, may_drop: bool = True) -> int | None:
        """One caller-owned device state slot, moving one snapshot out of the device tier if
        the pool is full; None when every slot is a working state or a pinned snapshot.
        `may_drop=False`: None rather than drop a snapshot (a slot is free, or the victim
        spills to the host tier: `room_without_drop`)."""
        if self.state_pool is None:
            raise ValueError("alloc_state on a cache without a state pool")
        if not may_drop and not self.room_without_drop():
            return None
        if self.state_pool.num_free == 0:
            self.evict_states(1)
        return self.state_pool.alloc_one()

    def attach_snapshot(self, node: TreeNode, state_slot: int, cls: str,
                        user: str | None = None) -> bool:
        """Attach device slot `state_slot` (the state covering `[0, node.depth)`) at `node`,
        which must be in the tree (e.g. the locked node from `commit`). True: the cache owns the
        slot now. False: a snapshot already sits there (its class is raised to `cls` if higher,
        `user` counted); the caller keeps `state_slot`."""
        if self.state_pool is None:
            raise ValueError("attach_snapshot on a cache without a state pool")
        class_rank(cls)  # an unknown class raises before anything changes
        if node is self.radix.root:
            raise ValueError("a snapshot at position 0 is the zero state; nothing to attach")
        self.radix.path_to_root(node)  # raises on a detached (evicted) handle
        if self.state_pool.is_free(state_slot):
            raise ValueError(f"state slot {state_slot} is not allocated")
        if node in self._snaps:
            old = self.tiers.keep(node, cls, user)
            log.debug(kv("snapshot_keep", pos=node.depth, slot=old.slot, tier=old.tier,
                         cls=old.cls))
            return False
        self.tiers.attach(node, state_slot, cls, user)
        self.tiers.supersede(node, user)
        log.debug(kv("snapshot", pos=node.depth, slot=state_slot, cls=cls))
        return True

    def renew(self, ids: Sequence[int] | torch.Tensor, points: Sequence[tuple[int, str]],
              resumed: int | None = None, user: str | None = None) -> int:
        """A request's snapshot points `(position, class)` at or before `resumed`, where its
        match resumed (the ones it need not take): the head and cut-point ones that find a
        snapshot at their position on `ids`' path are renewed (`SnapshotTiers.renew`, in
        position order). A head or a predicted cut that every request of a session names again
        (`head_end`, a tool list's cut, the oldest unpruned tool result) so stays as fresh as
        the session, where it aged from its first use before (#23: the post-compaction request
        found neither Claude Code's `head_end` nor its `<system-reminder>` break). With
        `resumed` and `user` (the session), a cut point on the path before `resumed` that only
        `user` used and this request does not name again is stale (the prediction was for the
        request after the one that made it, which went past it) and drops to class `anchor`.
        Returns how many were renewed; read-only on the tree."""
        want = {p: c for p, c in points if class_rank(c) >= class_rank(HEAD) and p >= 1}
        stale = resumed is not None and user is not None
        if (not want and not stale) or self.state_pool is None:
            return 0
        key = as_ids(ids)[: max([*want, resumed or 0])]
        n = 0
        for node in self.radix.walk(key)[0]:
            s = self._snaps.get(node)
            if s is None:
                continue
            if node.depth in want:
                self.tiers.renew(node, want[node.depth])
                n += 1
            elif stale and node.depth < resumed and s.cls == CUT_POINT and s.users == {user}:
                s.cls = ANCHOR  # a stale prediction (docstring)
                log.debug(kv("cut_stale", pos=node.depth, session=user))
        return n

    def insert_snapshot(self, ids_prefix: Sequence[int] | torch.Tensor, state_slot: int,
                        cls: str, user: str | None = None) -> bool:
        """`attach_snapshot` at the node ending exactly at `len(ids_prefix)` (splitting an edge
        if needed). False without taking the slot if `ids_prefix`'s KV is not fully cached."""
        key = as_ids(ids_prefix)
        path, n, partial, k = self.radix.walk(key)
        if n + k < len(key) or not key:
            log.debug(kv("snapshot_skip", pos=len(key), kv=n + k, why="prefix_not_cached"))
            return False
        node = path[-1] if partial is None else self.radix.split(partial, k)
        return self.attach_snapshot(node, state_slot, cls, user)

    def room_without_drop(self) -> bool:
        """A device state slot can be had without dropping a snapshot: one is free, or the
        host tier has room for the device tier's victim to spill into."""
        if self.state_pool is None:
            return False
        host = self.tiers.host
        return self.state_pool.num_free > 0 or (host is not None and host.num_free > 0)

    def evict_states(self, n: int) -> int:
        """Free up to `n` device slots held by unpinned snapshots, lowest value first; each
        moves to the host tier when it has room worth giving (a `spill` op) or is dropped.
        Returns how many device slots were freed. `evict_states(0)` is a no-op."""
        if self.state_pool is None:
            return 0
        return self.tiers.evict_device(n, self._pins)

    def drop_snapshot(self, node: TreeNode, why: str = "dropped") -> None:
        """Forget the (unpinned) snapshot at `node`, freeing its slot in its tier."""
        if node in self._pins:
            raise ValueError(f"snapshot at {node.depth} is pinned by a running request")
        self.tiers.drop(node, why)

    def snapshots(self) -> list[tuple[int, int, str]]:
        """`(position, slot, class)` of every snapshot, by position (for stats and tests)."""
        return sorted((node.depth, s.slot, s.cls) for node, s in self._snaps.items())

    def stats(self) -> dict[str, int]:
        out = dict(self.radix.stats(), **self.counters)
        if self.state_pool is not None:
            out.update(self.tiers.stats())
            if self.logits.pool.num_slots:
                out.update(self.logits.stats())
        return out
