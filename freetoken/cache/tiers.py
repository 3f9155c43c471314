"""The snapshot table of the hybrid radix cache: which radix node holds which snapshot, in
which tier, and what moves between the tiers when the device pool runs short.

Keys are radix nodes; the cache (`hybrid.py`) keeps them consistent with the tree (a node that
leaves the tree loses its snapshot through `drop`). `pinned` nodes (locked by a running
request) are never moved or dropped here.
"""
from __future__ import annotations

from collections.abc import Callable, Container, Hashable

from freetoken.cache.lineage import BACK, Lineage
from freetoken.cache.policy import CUT_POINT, HEAD, class_rank
from freetoken.cache.snapshots import (
    DEVICE,
    EVICTIONS,
    HOST,
    SPILL,
    Snapshot,
    StateOp,
    victim_key,
)
from freetoken.cache.state_pool import StatePool
from freetoken.log import get_logger, kv

log = get_logger("cache")

Node = Hashable


class SnapshotTiers:
    """Device + host snapshot bookkeeping under the value (or LRU) eviction rule."""

    def __init__(self, device: StatePool, host: StatePool | None, eviction: str,
                 horizon: int | None, depth: Callable[[Node], int],
                 parent: Callable[[Node], Node | None], lineage: Lineage | None = None) -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"unknown snapshot eviction {eviction!r}; known: {EVICTIONS}")
        self.device, self.host = device, host
        self.eviction = eviction
        total = device.num_slots + (host.num_slots if host is not None else 0)
        self.horizon = horizon if horizon is not None else max(2 * total, 1)
        self.depth, self.parent = depth, parent
        self.lineage = lineage if lineage is not None else Lineage()
        self._covered: set[Node] = set()  # nodes with a snapshot below them (see _victims)
        self.snaps: dict[Node, Snapshot] = {}
        self.ops: list[StateOp] = []
        # why the snapshot last attached at a node went away (for the per-request reason)
        self.gone: dict[Node, str] = {}
        self.clock = 0
        self.on_drop: Callable[[Node], None] | None = None  # told of every dropped snapshot
        self.counters = {"snapshots_taken": 0, "snapshots_evicted": 0, "snapshots_dropped": 0,
                         "snapshots_spilled": 0, "snapshots_restored": 0}

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def pool(self, tier: str) -> StatePool:
        pool = self.device if tier == DEVICE else self.host
        assert pool is not None
        return pool

    def _key(self, node: Node) -> tuple[int, int]:
        s = self.snaps[node]
        b = self.lineage.bonus(node, s.users)
        # a waiting parent's latest, heads and cut points do not age (snapshots.py)
        fresh = b is not None and (b == BACK or (class_rank(s.cls) >= class_rank(HEAD)
                                                 and self.lineage.waiting(s.users)))
        return victim_key(s, self.eviction, self.horizon, node in self._covered, b,
                          self.clock if fresh else None)

    def _victims(self, tier: str, pinned: Container[Node]) -> list[Node]:
        """Unpinned snapshots of `tier`, first victim first. Refreshes which snapshots have
        another snapshot below them (`_covered`), which `_key` reads until the next call."""
        covered: set[Node] = set()
        for n in self.snaps:
            x = self.parent(n)
            while x is not None and x not in covered:
                covered.add(x)
                x = self.parent(x)
        self._covered = covered
        return sorted((n for n, s in self.snaps.items() if s.tier == tier and n not in pinned),
                      key=self._key)

    def attach(self, node: Node, slot: int, cls: str, user: str | None) -> Snapshot:
        s = Snapshot(slot, cls, self.tick())
        if user is not None:
            s.users.add(user)
        self.snaps[node] = s
        self.lineage.touch(user, node)
        if cls == CUT_POINT:
            self.lineage.touch_cut(user, node)
        self.gone.pop(node, None)
        self.counters["snapshots_taken"] += 1
        return s

    def keep(self, node: Node, cls: str, user: str | None) -> Snapshot:
        """A snapshot already sits at `node` (same tokens, same state) and another is offered:
        the one there stays, its class raised to `cls` if higher, its use refreshed, `user`
        counted."""
        s = self.snaps[node]
        if class_rank(cls) > class_rank(s.cls):
            s.cls = cls
        s.last_access = self.tick()
        if user is not None:
            s.users.add(user)
            self.lineage.touch(user, node)
            if cls == CUT_POINT:
                self.lineage.touch_cut(user, node)
        return s

    def renew(self, node: Node, cls: str) -> Snapshot:
        """A request predicts again, at or before where it resumed, the head or cut point
        whose snapshot sits at `node`: its use refreshed (one tick), its class raised to `cls`
        if higher. Unlike `keep`, neither its users nor any session's latest change: the
        request passed it, it did not resume there."""
        s = self.snaps[node]
        if class_rank(cls) > class_rank(s.cls):
            s.cls = cls
        s.last_access = self.tick()
        return s

    def supersede(self, node: Node, user: str | None) -> None:
        """A deeper snapshot of `user`'s session now covers the path to `node`: the plain
        snapshots above it (class <= anchor, no other session) lose their resume bonus; a
        session that keeps appending resumed from them only because they were its latest."""
        mine = {user} if user is not None else set()
        x = self.parent(node)
        while x is not None:
            s = self.snaps.get(x)
            if s is not None and s.hits and s.users <= mine and class_rank(s.cls) <= 1:
                s.hits = 0
            x = self.parent(x)

    def drop(self, node: Node, why: str, counter: str = "snapshots_dropped") -> None:
        s = self.snaps.pop(node)
        self.lineage.forget_node(node)
        if self.on_drop is not None:
            self.on_drop(node)
        self.pool(s.tier).free([s.slot])
        self.gone[node] = f"{why}:{s.tier}"
        self.counters[counter] += 1
        event = "snapshot_evict" if counter == "snapshots_evicted" else "snapshot_drop"
        log.debug(kv(event, pos=self.depth(node), slot=s.slot, tier=s.tier, cls=s.cls, why=why))

    def forget(self, node: Node) -> None:
        """The node left the tree: no reason to remember about it."""
        self.gone.pop(node, None)

    def _host_slot_for(self, node: Node, pinned: Container[Node]) -> int | None:
        """A host slot for `node`'s snapshot, dropping a host snapshot of lower value if the
        host tier is full; None when there is no host tier or everything there is worth more."""
        if self.host is None or self.host.num_slots == 0:
            return None
        if self.host.num_free == 0:
            cands = self._victims(HOST, pinned)
            if not cands or self._key(cands[0]) > self._key(node):
                return None
            self.drop(cands[0], "host_full", "snapshots_evicted")
        return self.host.alloc_one()

    def evict_device(self, n: int, pinned: Container[Node]) -> int:
        """Free up to `n` device slots: each victim (lowest value first) moves to the host tier
        (one spill op) or, when the host keeps everything it has, is dropped."""
        if n <= 0:
            return 0
        cands = self._victims(DEVICE, pinned)[:n]
        for node in cands:
            s = self.snaps[node]
            hslot = self._host_slot_for(node, pinned)
            if hslot is None:
                self.drop(node, "device_full", "snapshots_evicted")
                continue
            self.ops.append(StateOp(SPILL, s.slot, hslot))
            self.device.free([s.slot])
            s.slot, s.tier = hslot, HOST
            self.counters["snapshots_spilled"] += 1
            log.debug(kv("snapshot_spill", pos=self.depth(node), host_slot=hslot, cls=s.cls,
                         keep_until=self._key(node)[0]))
        return len(cands)

    def stats(self) -> dict[str, int]:
        on_host = sum(1 for s in self.snaps.values() if s.tier == HOST)
        # `snapshots` are the device pool's (state_free + snapshots + working = state_slots)
        out = dict(self.counters, snapshots=len(self.snaps) - on_host, snapshots_host=on_host,
                   state_free=self.device.num_free, state_slots=self.device.num_slots)
        if self.host is not None:
            out.update(host_state_free=self.host.num_free, host_state_slots=self.host.num_slots)
        return out
