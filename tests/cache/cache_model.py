"""Independent reference for the radix caches: a flat dict of cached prefixes.

The model knows nothing about nodes or edges. It keeps every cached prefix (a token tuple) with
the KV slot of its last token, the logical time it was last touched, the snapshots by prefix
(tier, class, time, resumes, users), and the prefixes each simulated request holds locked.
Snapshot eviction is written here a second time from the rule in `freetoken.cache`'s
docstring (value levels, session lineage, host spill, host replacement). `check_*`
functions compare the real tree against it after every operation.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from freetoken.cache import CLASS_RANK, HybridRadixCache, RadixCache, SlotAllocator, StatePool
from freetoken.cache.node import TreeNode

Prefix = tuple[int, ...]


@dataclass
class RefModel:
    kv: dict[Prefix, int] = field(default_factory=dict)  # prefix -> KV slot of its last token
    kt: dict[Prefix, int] = field(default_factory=dict)  # prefix -> last touch time
    # prefix -> {slot (device slot; None on the host), cls, t, tier, hits, users}
    snaps: dict[Prefix, dict] = field(default_factory=dict)
    clock: int = 0
    sclock: int = 0
    horizon: int = 1
    host_slots: int = 0
    # session lineage, written from the rule in `freetoken.cache.lineage`'s docstring:
    # key -> {parent, declared, inflight, started, waited, finished, latest (prefix),
    #         latest_cut (prefix: the deepest cut point its latest request attached)}
    lin: dict[str, dict] = field(default_factory=dict)
    lclock: int = 0

    # -- lineage --------------------------------------------------------------------------------

    def begin(self, key: str, parent: str | None, resumed: Prefix | None) -> None:
        self.lclock += 1
        new = key not in self.lin
        s = self.lin.setdefault(key, {"parent": None, "declared": False, "inflight": 0,
                                      "started": 0, "waited": True, "finished": False,
                                      "latest": None, "latest_cut": None})
        p = None
        if parent is not None:
            if parent in self.lin:
                p = parent
            else:
                tops = [k for k, v in self.lin.items()
                        if v["parent"] is None and k.startswith(parent)]
                p = max(tops, key=lambda k: self.lin[k]["started"]) if tops else None
        declared = p is not None
        if p is None and new and parent is None and resumed:
            users = self.snaps[resumed]["users"] if resumed in self.snaps else set()
            tops = [u for u in users if u != key and u in self.lin
                    and self.lin[u]["parent"] is None and self.lin[u]["latest"] != resumed]
            p = max(tops, key=lambda k: self.lin[k]["started"]) if tops else None
        has_kids = any(v["parent"] == key for v in self.lin.values())
        if p is not None and p != key and s["parent"] is None and not has_kids:
            s["parent"], s["declared"] = p, declared
        if s["parent"] is not None and (new or s["finished"] or s["inflight"] == 0):
            s["waited"] = self.lin[s["parent"]]["inflight"] == 0
        s["finished"] = False
        s["latest_cut"] = None
        for c in [k for k, v in self.lin.items() if v["parent"] == key]:
            kid = self.lin[c]
            if kid["declared"] and kid["inflight"] == 0 and kid["waited"] and not kid["finished"]:
                kid["finished"] = True
            elif kid["inflight"]:
                kid["waited"] = False
        s["inflight"] += 1
        s["started"] = self.lclock

    def end(self, key: str) -> None:
        if key in self.lin and self.lin[key]["inflight"] > 0:
            self.lin[key]["inflight"] -= 1

    def touch_latest(self, user: str | None, p: Prefix) -> None:
        if user is not None and user in self.lin:
            self.lin[user]["latest"] = p

    def touch_cut(self, user: str | None, p: Prefix) -> None:
        if user is not None and user in self.lin:
            self.lin[user]["latest_cut"] = p

    def del_snap(self, p: Prefix) -> None:
        del self.snaps[p]
        for v in self.lin.values():
            if v["latest"] == p:
                v["latest"] = None
            if v["latest_cut"] == p:
                v["latest_cut"] = None

    def lineage_term(self, p: Prefix) -> int | None:
        users = self.snaps[p]["users"]
        if users and all(u in self.lin and self.lin[u]["finished"] for u in users):
            return None
        best = 0
        for u in users:
            v = self.lin.get(u)
            if v is not None and p in (v["latest"], v["latest_cut"]):
                if self.waiting(u):
                    return 3
                best = 2
        return best

    def waiting(self, u: str) -> bool:
        return any(not w["finished"] for w in self.lin.values() if w["parent"] == u)

    def longest(self, ids: list[int]) -> int:
        i = 0
        while i < len(ids) and tuple(ids[: i + 1]) in self.kv:
            i += 1
        return i

    def slots(self, ids: list[int], n: int) -> list[int]:
        return [self.kv[tuple(ids[: i + 1])] for i in range(n)]

    def touch(self, ids: list[int], n: int) -> None:
        self.clock += 1
        for i in range(1, n + 1):
            self.kt[tuple(ids[:i])] = self.clock

    def deepest_snapshot(self, ids: list[int], limit: int) -> int:
        return max([p for p in range(1, limit + 1) if tuple(ids[:p]) in self.snaps], default=0)

    def value_key(self, p: Prefix) -> tuple[int, int]:
        v = self.snaps[p]
        covered = any(len(q) > len(p) and q[: len(p)] == p for q in self.snaps)
        plain = covered and len(v["users"]) <= 1 and CLASS_RANK[v["cls"]] <= 1
        level = CLASS_RANK[v["cls"]] + (v["hits"] >= 1) + 2 * (len(v["users"]) >= 2) - 2 * plain
        term = self.lineage_term(p)
        high = CLASS_RANK[v["cls"]] >= CLASS_RANK["head"]
        if term is None:  # finished sub-agents only: heads and cut points keep their level
            level = level if high else -2
        else:
            level += term
        # a waiting parent's latest, heads and cut points count as used now
        fresh = term == 3 or (term is not None and high
                              and any(self.waiting(u) for u in v["users"]))
        t = self.sclock if fresh else v["t"]
        return (t + level * self.horizon, v["t"])

    def victims(self, tier: str, pinned: set[Prefix]) -> list[Prefix]:
        keys = {p: self.value_key(p) for p, v in self.snaps.items()
                if v["tier"] == tier and p not in pinned}
        return sorted(keys, key=keys.__getitem__)

    def evict_device(self, pinned: set[Prefix], n: int) -> list[tuple[Prefix, int, str]]:
        """Apply device eviction of up to `n`; return `(prefix, old device slot, outcome)` with
        outcome `spill` or `drop`, in order (host drops made to fit a spill are applied too)."""
        out = []
        cands = self.victims("device", pinned)[:n]
        for p in cands:
            v = self.snaps[p]
            on_host = sum(1 for x in self.snaps.values() if x["tier"] == "host")
            ok = self.host_slots > 0
            if ok and on_host >= self.host_slots:
                hv = self.victims("host", pinned)
                ok = bool(hv) and self.value_key(hv[0]) < self.value_key(p)
                if ok:
                    self.del_snap(hv[0])
            out.append((p, v["slot"], "spill" if ok else "drop"))
            if ok:
                v["tier"], v["slot"] = "host", None
            else:
                self.del_snap(p)
        return out


def node_prefix(node: TreeNode) -> Prefix:
    parts: list[list[int]] = []
    x: TreeNode | None = node
    while x is not None and x.parent is not None:
        parts.append(x.key)
        x = x.parent
    return tuple(t for part in reversed(parts) for t in part)


def dump_tree(radix: RadixCache) -> tuple[dict[Prefix, int], dict[Prefix, int], list[TreeNode]]:
    """Walk the tree, checking its structure; return prefix->slot, prefix->time, nodes."""
    kv: dict[Prefix, int] = {}
    kt: dict[Prefix, int] = {}
    nodes: list[TreeNode] = []
    stack: list[tuple[TreeNode, Prefix]] = [(radix.root, ())]
    while stack:
        node, pre = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node, "broken parent pointer"
            assert child.key and child.key[0] == first, "child keyed by the wrong token"
            assert child.value.numel() == len(child.key), "value/key length mismatch"
            assert child.depth == len(pre) + len(child.key), "wrong depth"
            assert child.last_access <= node.last_access or node is radix.root, \
                "ancestor older than descendant"
            vals = child.value.tolist()
            p = pre
            for t, s in zip(child.key, vals):
                p = p + (t,)
                kv[p] = s
                kt[p] = child.last_access
            nodes.append(child)
            stack.append((child, p))
    return kv, kt, nodes


def check_monotone(pairs: list[tuple[int, int]]) -> None:
    """Reference times and real times must induce the same order (ties included)."""
    pairs = sorted(set(pairs))
    for (ra, ta), (rb, tb) in itertools.pairwise(pairs):
        assert ra < rb, f"one reference time maps to two real times: {ra}->{ta},{tb}"
        assert ta < tb, f"LRU order differs from reference: ref {ra}<{rb} but real {ta}>={tb}"


def check_tree(radix: RadixCache, ref: RefModel, locks: list[Prefix]) -> list[TreeNode]:
    """Content, prefix closure, LRU times, lock counts and size accounting."""
    kv, kt, nodes = dump_tree(radix)
    assert kv == ref.kv, f"tree content differs: extra {set(kv) - set(ref.kv)}, " \
                         f"missing {set(ref.kv) - set(kv)}"
    for p in kv:
        assert len(p) == 1 or p[:-1] in kv, f"prefix closure broken at {p}"
    check_monotone([(ref.kt[p], kt[p]) for p in kv])
    ev = pr = 0
    for node in nodes:
        pre = node_prefix(node)
        want = sum(1 for lk in locks if lk[: len(pre)] == pre and len(lk) >= len(pre))
        assert node.lock_ref == want, f"lock_ref {node.lock_ref} != {want} at {pre}"
        if node.lock_ref:
            pr += len(node.key)
        else:
            ev += len(node.key)
    assert (radix.evictable_size, radix.protected_size) == (ev, pr)
    assert radix.total_size == len(kv)
    return nodes


def check_slots(alloc: SlotAllocator, held_by_tree: list[int], held_by_callers: list[int]) -> None:
    """Conservation: free + tree + callers == every slot, each exactly once."""
    free = alloc.free_slots()
    everything = free + held_by_tree + held_by_callers
    assert len(everything) == alloc.num_slots, (
        f"{alloc.kind}: free {len(free)} + tree {len(held_by_tree)} + callers "
        f"{len(held_by_callers)} != {alloc.num_slots}")
    assert sorted(everything) == list(range(alloc.num_slots)), f"{alloc.kind} slot in two places"
    assert all(alloc.is_free(s) for s in free)
    assert not any(alloc.is_free(s) for s in held_by_tree + held_by_callers)


def check_snapshots(cache: HybridRadixCache, ref: RefModel, pool: StatePool,
                    working: list[int], host: StatePool | None = None) -> None:
    real = {node_prefix(n): (s.slot if s.tier == "device" else None, s.cls, s.tier, s.hits,
                             s.users) for n, s in cache._snaps.items()}
    want = {p: (v["slot"], v["cls"], v["tier"], v["hits"], v["users"])
            for p, v in ref.snaps.items()}
    assert real == want, "snapshots differ"
    for n in cache._snaps:
        assert n.parent is not None, "snapshot on an evicted node"
    for n, s in cache._snaps.items():  # value keys add to times: the clocks must agree exactly
        assert s.last_access == ref.snaps[node_prefix(n)]["t"], "snapshot clock differs"
    check_slots(pool, [v["slot"] for v in ref.snaps.values() if v["tier"] == "device"], working)
    if host is not None:
        check_slots(host, [s.slot for s in cache._snaps.values() if s.tier == "host"], [])


def check_eviction(ref: RefModel, real_kv: dict[Prefix, int], want: int,
                   locked: set[Prefix]) -> set[Prefix]:
    """Validate the prefixes the tree dropped against LRU-of-leaves; return them."""
    assert set(real_kv) <= set(ref.kv), "eviction added prefixes"
    removed = set(ref.kv) - set(real_kv)
    if want <= 0:
        assert not removed, "evicted without being asked to"
        return removed
    assert not removed & locked, "evicted a locked prefix"
    for r in removed:  # whole subtrees go: nothing below an evicted prefix stays
        assert not any(p[: len(r)] == r for p in real_kv), f"evicted {r} but kept an extension"
    left = set(real_kv)
    unlocked_left = left - locked
    if len(removed) < want:
        assert not unlocked_left, "stopped short while evictable prefixes remained"
    if removed:
        tmax = max(ref.kt[r] for r in removed)
        parents = {p[:-1] for p in left}
        leaves = [p for p in unlocked_left if p not in parents]
        assert all(ref.kt[p] >= tmax for p in leaves), "evicted a newer leaf before an older one"
        older = sum(1 for r in removed if ref.kt[r] < tmax)
        assert older < want, "kept evicting after enough was freed"
    return removed
