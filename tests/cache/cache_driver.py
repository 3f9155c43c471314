"""Random operation sequences against a radix cache, checked against `RefModel` after each.

The driver plays the scheduler: requests match, lock, allocate, commit chunks (optionally
snapshotting state), finish (donating state) or abort; between them it evicts KV and snapshots,
inserts raw sequences and snapshots, and matches. Modes: `radix` (RadixCache directly),
`plain` (HybridRadixCache without a state pool), `hybrid` (with a state pool), `tiered` (with
a state pool and a host tier, a short value horizon so the value terms decide evictions).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from cache_model import (
    Prefix,
    RefModel,
    check_eviction,
    check_slots,
    check_snapshots,
    check_tree,
    dump_tree,
    node_prefix,
)

from freetoken.cache import CLASS_RANK, HybridRadixCache, RadixCache, SlotAllocator, StatePool
from freetoken.cache.node import TreeNode

CLASSES = ["end", "anchor", "interval", "head", "cut_point"]
USERS = [None, "s1", "s2", "s3"]
# sessions of requests and the parent key each sends: sub-agents of s1 by its key, of the
# latest "s*" by prefix, and sessions without one (their parent, if any, from structure)
SESSIONS = [("s1", None), ("s2", None), ("s3", None), ("k1", "s1"), ("k2", "s"),
            ("k3", None), ("k4", "s9")]


@dataclass
class Req:
    ids: list[int]
    row: list[int]  # KV slot per computed token; row[:tree_len] tree-owned, the rest owned here
    tree_len: int
    node: TreeNode
    working: int | None = None  # state slot owned by the request
    session: str | None = None  # begun in the cache's lineage (end pending)
    matched: int = 0  # where its match resumed


class Driver:
    def __init__(self, mode: str, seed: int, kv_slots: int = 40, state_slots: int = 5,
                 host_slots: int = 3) -> None:
        self.mode, self.rng = mode, random.Random(seed)
        self.alloc = SlotAllocator(kv_slots)
        self.pool = StatePool(state_slots) if mode in ("hybrid", "tiered") else None
        self.host = StatePool(host_slots) if mode == "tiered" else None
        self.radix_only = mode == "radix"
        horizon = 3 if mode == "tiered" else None
        self.cache: RadixCache | HybridRadixCache = (
            RadixCache(self.alloc) if self.radix_only
            else HybridRadixCache(self.alloc, self.pool, host_pool=self.host, horizon=horizon))
        self.radix = self.cache if isinstance(self.cache, RadixCache) else self.cache.radix
        self.ref = RefModel()
        if isinstance(self.cache, HybridRadixCache):
            self.ref.horizon = self.cache.tiers.horizon
            self.ref.host_slots = host_slots if self.host is not None else 0
        self.reqs: list[Req] = []
        self.sessions = SESSIONS

    # -- reference helpers ----------------------------------------------------------------------

    def locks(self) -> list[Prefix]:
        return [tuple(r.ids[: r.tree_len]) for r in self.reqs]

    def locked(self) -> set[Prefix]:
        return {lk[:i] for lk in self.locks() for i in range(1, len(lk) + 1)}

    def sync_eviction(self, want: int) -> int:
        real_kv = dump_tree(self.radix)[0]
        removed = check_eviction(self.ref, real_kv, want, self.locked())
        for p in removed:
            del self.ref.kv[p], self.ref.kt[p]
            if p in self.ref.snaps:  # KV eviction drops the node's snapshot
                self.ref.del_snap(p)
        return len(removed)

    def alloc_kv(self, n: int) -> torch.Tensor | None:
        want = n - self.alloc.num_free
        out = self.radix.alloc(n)
        self.sync_eviction(want)
        if out is None:  # only when even evicting every unlocked prefix left too little room
            assert n > self.alloc.num_free and not set(self.ref.kv) - self.locked()
        else:
            assert out.numel() == n
        return out

    def evict_device(self, n: int, real) -> object:
        """Device eviction of up to `n` in the reference, `real()` in the cache (it must evict
        the same); the spill ops must name the same slots. Returns `real()`'s result."""
        assert isinstance(self.cache, HybridRadixCache)
        moves = self.ref.evict_device(set(self.locks()), n)
        out = real()
        ops = self.cache.take_ops()
        spilled = [m for m in moves if m[2] == "spill"]
        assert [(o.kind, o.src) for o in ops] == [("spill", old) for _, old, _ in spilled], \
            (ops, moves)
        host_of = {node_prefix(x): s.slot for x, s in self.cache._snaps.items()}
        for o, (p, _, _) in zip(ops, spilled):  # a later spill of the same call may replace it
            assert p not in self.ref.snaps or host_of[p] == o.dst, "spill to the wrong host slot"
        self.moves = moves
        return out

    def alloc_state(self) -> int | None:
        assert isinstance(self.cache, HybridRadixCache) and self.pool is not None
        full = self.pool.num_free == 0
        slot = self.evict_device(1 if full else 0, self.cache.alloc_state)
        assert (slot is None) == (full and not self.moves)
        return slot

    def attach_ref(self, prefix: Prefix, slot: int, cls: str, user: str | None = None) -> bool:
        self.ref.sclock += 1
        old = self.ref.snaps.get(prefix)
        self.ref.touch_latest(user, prefix)
        if cls == "cut_point":
            self.ref.touch_cut(user, prefix)
        if old is None:
            mine = {user} if user else set()
            self.ref.snaps[prefix] = {"slot": slot, "cls": cls, "t": self.ref.sclock,
                                      "tier": "device", "hits": 0, "users": mine}
            for i in range(1, len(prefix)):  # superseded: same session, plain class
                v = self.ref.snaps.get(prefix[:i])
                if v is not None and v["users"] <= mine and CLASS_RANK[v["cls"]] <= 1:
                    v["hits"] = 0
            return True
        if CLASS_RANK[cls] > CLASS_RANK[old["cls"]]:
            old["cls"] = cls
        old["t"] = self.ref.sclock
        if user:
            old["users"].add(user)
        return False

    def gen_ids(self) -> list[int]:
        rng = self.rng
        bases = [list(p) for p in self.ref.kv] + [r.ids for r in self.reqs]
        if bases and rng.random() < 0.7:
            base = rng.choice(bases)
            ids = base[: rng.randint(0, len(base))]
        else:
            ids = []
        ids += [rng.randrange(3) for _ in range(rng.randint(0 if ids else 1, 8))]
        return ids[:24]

    # -- operations -----------------------------------------------------------------------------

    def op_match(self, ids: list[int], user: str | None = None,
                 as_user: bool = False) -> tuple[TreeNode, int, list[int]]:
        ref = self.ref
        if isinstance(self.cache, RadixCache):
            m = self.cache.match_prefix(ids)
            n = ref.longest(ids)
            assert m.length == n and m.node.depth == n
            assert m.slots.tolist() == ref.slots(ids, n)
            ref.touch(ids, n)
            return m.node, n, m.slots.tolist()
        user = user if as_user else self.rng.choice(USERS)
        hm = self.cache.match(ids, user)
        cap = max(len(ids) - 1, 0)
        kv_len = ref.longest(ids[:cap])
        use = ref.deepest_snapshot(ids, kv_len) if self.pool is not None else kv_len
        assert (hm.length, hm.kv_len, hm.node.depth) == (use, kv_len, use), (hm, use, kv_len)
        assert hm.kv_slots.tolist() == ref.slots(ids, use)
        if self.pool is not None and use > 0:
            snap = ref.snaps[tuple(ids[:use])]
            assert (hm.state_len, hm.state_class, hm.state_tier) == (use, snap["cls"],
                                                                     snap["tier"])
            if snap["tier"] == "device":
                assert hm.state_slot == snap["slot"]
            ref.sclock += 1
            snap["t"] = ref.sclock
            snap["hits"] += 1
            if user:
                snap["users"].add(user)
                ref.touch_latest(user, tuple(ids[:use]))
        else:
            assert (hm.state_len, hm.state_slot, hm.state_class, hm.state_tier) == (
                0, -1, None, None)
        if not ids:
            assert hm.reason == "empty"
        elif use == cap:
            assert hm.reason == "last_token"
        elif use < kv_len:
            assert hm.reason == f"no_snapshot_after={use}"
        else:
            assert hm.reason == f"kv_miss_at={kv_len}"
        ref.touch(ids, use)
        self.last_match = hm
        return hm.node, use, hm.kv_slots.tolist()

    def op_start(self) -> None:
        ids = self.gen_ids()
        lineage = self.pool is not None and self.rng.random() < 0.8
        session, parent = self.rng.choice(self.sessions)
        if lineage and session.startswith("k"):  # a sub-agent's own turn: a token of its own
            ids = (ids + [2 + int(session[1])] + [self.rng.randrange(3)])[-24:]
        node, n, slots = self.op_match(ids, session, as_user=lineage)
        self.cache.lock(node)
        r = Req(ids, slots, n, node, matched=n)
        if lineage:
            assert isinstance(self.cache, HybridRadixCache)
            self.cache.begin(session, parent, self.last_match)
            self.ref.begin(session, parent, tuple(ids[:n]) if n else None)
            r.session = session
        self.reqs.append(r)
        self.check()
        own = self.alloc_kv(len(ids) - n)
        if own is not None:
            r.row += own.tolist()
        if own is not None and self.pool is not None:
            r.working = self.alloc_state()
        if own is None or (self.pool is not None and r.working is None):
            self.abort(r)

    def commit(self, r: Req, n: int) -> None:
        ref = self.ref
        p = ref.longest(r.ids[:n])
        assert p >= r.tree_len
        for i in range(p, n):
            ref.kv[tuple(r.ids[: i + 1])] = r.row[i]
        ref.touch(r.ids, n)
        c = self.cache.commit(r.ids[:n], torch.tensor(r.row[:n], dtype=torch.long), r.node,
                              r.tree_len)
        assert (c.prefix_len, c.freed, c.node.depth) == (p, p - r.tree_len, n)
        r.row = ref.slots(r.ids, n) + r.row[n:]
        assert c.slots.tolist() == r.row[:n]
        r.node, r.tree_len = c.node, n

    def op_chunk(self, r: Req) -> None:
        n = self.rng.randint(r.tree_len, len(r.ids))
        snap = self.pool is not None and n >= 1 and self.rng.random() < 0.6
        slot = self.alloc_state() if snap else None
        self.commit(r, n)
        if slot is not None:
            assert isinstance(self.cache, HybridRadixCache)
            cls = self.rng.choice(CLASSES)
            user = r.session if r.session and self.rng.random() < 0.7 else self.rng.choice(USERS)
            taken = self.cache.attach_snapshot(r.node, slot, cls, user)
            assert taken == self.attach_ref(tuple(r.ids[:n]), slot, cls, user)
            if not taken:
                self.pool.free([slot])

    def op_finish(self, r: Req) -> None:
        """Finish step by step: commit everything, donate the working state, unlock."""
        self.commit(r, len(r.ids))
        if r.working is not None:
            assert isinstance(self.cache, HybridRadixCache) and self.pool is not None
            taken = self.cache.attach_snapshot(r.node, r.working, "end")
            assert taken == self.attach_ref(tuple(r.ids), r.working, "end")
            if not taken:
                self.pool.free([r.working])
        self.cache.unlock(r.node)
        self.reqs.remove(r)
        _end(self, r)

    def op_release(self, r: Req) -> None:
        """Finish through `release` (commit + donate + unlock in one call)."""
        ref = self.ref
        p = ref.longest(r.ids)
        for i in range(p, len(r.ids)):
            ref.kv[tuple(r.ids[: i + 1])] = r.row[i]
        ref.touch(r.ids, len(r.ids))
        row = torch.tensor(r.row, dtype=torch.long)
        self.reqs.remove(r)
        _end(self, r)
        if isinstance(self.cache, RadixCache):
            assert self.cache.release(r.ids, row, r.node, r.tree_len) == p
            return
        donate = r.working if r.ids else None
        rel = self.cache.release(r.ids, row, r.node, r.tree_len, state_slot=donate)
        want = donate is not None and self.attach_ref(tuple(r.ids), donate, "end")
        assert rel == (p, want)
        if r.working is not None and not rel.snapshot_taken:
            self.pool.free([r.working])

    def abort(self, r: Req) -> None:
        self.alloc.free(r.row[r.tree_len :])
        if r.working is not None:
            self.pool.free([r.working])
        self.cache.unlock(r.node)
        self.reqs.remove(r)
        _end(self, r)

    def op_raw_insert(self) -> None:
        ids = self.gen_ids()
        own = self.alloc_kv(len(ids))
        if own is None:
            return
        p = self.ref.longest(ids)
        for i in range(p, len(ids)):
            self.ref.kv[tuple(ids[: i + 1])] = int(own[i])
        self.ref.touch(ids, len(ids))
        assert self.cache.insert(ids, own) == p
        self.alloc.free(own[:p])  # all of `own` was ours, so the duplicates are ours to free

    def op_insert_snapshot(self) -> None:
        assert isinstance(self.cache, HybridRadixCache)
        ids = self.gen_ids()
        slot = self.alloc_state()
        if slot is None:
            return
        cls = self.rng.choice(CLASSES)
        cached = bool(ids) and self.ref.longest(ids) == len(ids)
        want = cached and self.attach_ref(tuple(ids), slot, cls)
        assert self.cache.insert_snapshot(ids, slot, cls) == want
        if not want:
            self.pool.free([slot])

    def op_renew(self, r: Req) -> None:
        """`renew` of a running request's points at or before where it resumed: heads and cut
        points named again are refreshed and raised; the session's own cut points it resumed
        past and does not name go down to `anchor` (`HybridRadixCache.renew`'s rule)."""
        assert isinstance(self.cache, HybridRadixCache)
        rng, ref, n = self.rng, self.ref, r.matched
        on_path = [q for q in range(1, n + 1) if tuple(r.ids[:q]) in ref.snaps]
        ps = set(rng.sample(range(1, n + 1), rng.randint(0, min(n, 2))) if n else [])
        ps |= {q for q in on_path if rng.random() < 0.5}  # mostly where snapshots sit
        points = sorted((p, rng.choice(CLASSES)) for p in ps)
        user = r.session
        got = self.cache.renew(r.ids, points, n, user)
        want = {p: c for p, c in points if CLASS_RANK[c] >= CLASS_RANK["head"]}
        renewed = 0
        for q in range(1, n + 1):
            v = ref.snaps.get(tuple(r.ids[:q]))
            if v is None:
                continue
            if q in want:
                ref.sclock += 1
                v["t"] = ref.sclock
                if CLASS_RANK[want[q]] > CLASS_RANK[v["cls"]]:
                    v["cls"] = want[q]
                renewed += 1
            elif user is not None and q < n and v["cls"] == "cut_point" and v["users"] == {user}:
                v["cls"] = "anchor"
        assert got == renewed

    def op_evict_states(self) -> None:
        k = self.rng.randint(0, 3)
        assert self.evict_device(k, lambda: self.cache.evict_states(k)) == len(self.moves)

    def step(self) -> None:
        rng = self.rng
        ops = ["start", "evict", "match", "raw"] + ["chunk", "finish", "abort"] * bool(self.reqs)
        if self.pool is not None:
            ops += ["snap", "evict_states"] + ["renew"] * bool(self.reqs)
        op = rng.choice(ops)
        if op == "start" and len(self.reqs) < 4:
            self.op_start()
        elif op == "evict":
            k = rng.randint(0, 12)
            assert self.cache.evict(k) == self.sync_eviction(k)
        elif op == "match":
            self.op_match(self.gen_ids())
        elif op == "raw":
            self.op_raw_insert()
        elif op == "chunk":
            self.op_chunk(rng.choice(self.reqs))
        elif op == "finish":
            r = rng.choice(self.reqs)
            self.op_release(r) if rng.random() < 0.5 else self.op_finish(r)
        elif op == "abort":
            self.abort(rng.choice(self.reqs))
        elif op == "snap":
            self.op_insert_snapshot()
        elif op == "evict_states":
            self.op_evict_states()
        elif op == "renew":
            self.op_renew(rng.choice(self.reqs))
        self.check()

    def check(self) -> None:
        check_tree(self.radix, self.ref, self.locks())
        owned = [s for r in self.reqs for s in r.row[r.tree_len :]]
        check_slots(self.alloc, list(self.ref.kv.values()), owned)
        if self.pool is not None:
            assert isinstance(self.cache, HybridRadixCache)
            working = [r.working for r in self.reqs if r.working is not None]
            check_snapshots(self.cache, self.ref, self.pool, working, self.host)
            real = {k: (s.parent, s.declared, s.inflight, s.finished,
                        None if s.latest is None else node_prefix(s.latest),
                        None if s.latest_cut is None else node_prefix(s.latest_cut))
                    for k, s in self.cache.lineage.sessions.items()}
            want = {k: (v["parent"], v["declared"], v["inflight"], v["finished"], v["latest"],
                        v["latest_cut"]) for k, v in self.ref.lin.items()}
            assert real == want, "lineage differs"


def _end(d: Driver, r: Req) -> None:
    if r.session is not None:
        assert isinstance(d.cache, HybridRadixCache)
        d.cache.end(r.session)
        d.ref.end(r.session)
        r.session = None
