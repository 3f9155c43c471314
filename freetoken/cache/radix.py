"""Radix tree over token ids whose nodes hold the KV slots of their edge's tokens.

Page size 1: node `x` covers tokens `[x.depth - len(x.key), x.depth)` of every sequence through
it, and `x.value[i]` is the KV slot of token `x.key[i]`. The tree owns every slot stored in it.

Life of a request (what the scheduler does; who owns which slots):

1. `m = cache.match_prefix(ids)`; `cache.lock(m.node)`. `m.slots` are tree-owned and safe to
   read only while some lock covers `m.node` (locked nodes and their ancestors are never
   evicted). The request records `tree_len = m.length`. (A scheduler uses
   `HybridRadixCache.match` instead: it caps reuse at `len(ids) - 1` so logits can be computed.)
2. `own = cache.alloc(len(ids) - m.length)` (evicts unlocked LRU leaves if the pool is short;
   `None` = cannot fit now). The request owns `own`; its slot row is `cat(m.slots, own)`.
3. After a prefill chunk (optional) and at finish: `c = cache.commit(ids[:n], row[:n], node,
   tree_len)`: the tree takes the request's slots, frees the request's duplicates of tokens that
   another request cached meanwhile, moves the lock to `c.node`; the request continues with
   `row = cat(c.slots, row[n:])`, `node = c.node`, `tree_len = n`. At finish: `commit` then
   `unlock(c.node)` (or `release`).
4. Abort: `allocator.free(row[tree_len:])`; `cache.unlock(node)`.

`evict(0)` is always safe. LRU time is a logical clock bumped once per match/insert, so every
node on a touched path gets the same time and an ancestor is never older than its descendants.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from freetoken.cache.allocator import SlotAllocator
from freetoken.cache.node import TreeNode, as_ids, common_len
from freetoken.log import get_logger, kv

log = get_logger("cache")

_EMPTY = torch.empty(0, dtype=torch.long)


class MatchResult(NamedTuple):
    """`slots[i]` is the KV slot of `ids[i]` for `i < length`; `node` ends exactly at `length`
    (the root when `length == 0`). Tree-owned: lock `node` before anything can evict."""

    slots: torch.Tensor  # [length]
    node: TreeNode
    length: int


class Committed(NamedTuple):
    """Result of `commit`: `slots` (tree-owned, `[len(ids)]`) replace the caller's row prefix,
    `node` (now locked for the caller) ends at `len(ids)`, `prefix_len` tokens were already
    cached, and `freed` caller duplicates went back to the allocator."""

    slots: torch.Tensor  # [len(ids)]
    node: TreeNode
    prefix_len: int
    freed: int


class RadixCache:
    """Prefix cache of KV slots. `on_evict(node)` runs for each node just before it is removed."""

    def __init__(self, allocator: SlotAllocator,
                 on_evict: Callable[[TreeNode], None] | None = None) -> None:
        self.allocator = allocator
        self.on_evict = on_evict
        self._clock = 0
        self._uid = 0
        self.root = TreeNode([], _EMPTY, None, 0, self._next_uid(), 0)
        self.root.lock_ref = 1  # the root is never evicted and never counted
        self.evictable_size = 0  # tokens in nodes with lock_ref == 0
        self.protected_size = 0  # tokens in nodes with lock_ref > 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _next_uid(self) -> int:
        self._uid += 1
        return self._uid

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookup -------------------------------------------------------------------------------

    def walk(self, key: list[int]) -> tuple[list[TreeNode], int, TreeNode | None, int]:
        """Read-only descent: `(path, n, partial, k)` where `path` are the fully matched nodes
        (ending at `n`) and `partial`, if not None, matches `k >= 1` more tokens of its edge."""
        node, n, path = self.root, 0, list[TreeNode]()
        while n < len(key):
            child = node.children.get(key[n])
            if child is None:
                break
            k = common_len(child.key, key, n)
            if k < len(child.key):
                return path, n, child, k
            path.append(child)
            n += k
            node = child
        return path, n, None, 0

    def touch(self, path: list[TreeNode]) -> None:
        now = self._tick()
        for x in path:
            x.last_access = now

    def lookup(self, key: list[int]) -> MatchResult:
        """`match_prefix` without the log line (for callers that log their own decision)."""
        path, n, partial, k = self.walk(key)
        if partial is not None:
            path.append(self.split(partial, k))
            n += k
        self.touch(path)
        node = path[-1] if path else self.root
        slots = torch.cat([x.value for x in path]) if path else _EMPTY.clone()  # [n]
        return MatchResult(slots, node, n)

    def match_prefix(self, ids: Sequence[int] | torch.Tensor) -> MatchResult:
        """Longest cached prefix of `ids`. Splits the node where the match ends inside an edge,
        so the returned node ends exactly at `length`; marks the matched path recently used."""
        m = self.lookup(as_ids(ids))
        log.debug(kv("match", tokens=len(ids), kv=m.length))
        return m

    def split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut `child`'s edge after `k` tokens; return the new upper node. `child` keeps its
        identity (handles and locks held on it stay valid) and its end position."""
        assert 0 < k < len(child.key)
        parent = child.parent
        assert parent is not None
        depth = child.depth - len(child.key) + k
        up = TreeNode(child.key[:k], child.value[:k].clone(), parent, depth, self._next_uid(),
                      child.last_access)
        up.lock_ref = child.lock_ref  # every lock through child passes through up
        parent.children[up.key[0]] = up
        child.key = child.key[k:]
        child.value = child.value[k:].clone()
        child.parent = up
        up.children[child.key[0]] = child
        return up

    # -- insert -------------------------------------------------------------------------------

    def insert(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor) -> int:
        """Cache `ids` with KV slots `slots` (`[len(ids)]`); return `p`, the number of leading
        tokens that were already cached.

        Ownership: the tree takes `slots[p:]`. It does NOT take `slots[:p]`; the tree keeps its
        own slots for that prefix. Of `slots[:p]`, the caller must free exactly those it
        allocated itself (not those it got from `match_prefix`); `commit` does this for you.
        """
        key = as_ids(ids)
        if slots.numel() != len(key):
            raise ValueError(f"insert: {len(key)} ids but {slots.numel()} slots")
        now = self._tick()
        node, n = self.root, 0
        while n < len(key):
            child = node.children.get(key[n])
            if child is None:
                leaf = TreeNode(key[n:], slots[n:].clone(), node, len(key), self._next_uid(), now)
                node.children[key[n]] = leaf
                self.evictable_size += len(leaf.key)
                break
            k = common_len(child.key, key, n)
            if k < len(child.key):
                child = self.split(child, k)
            child.last_access = now
            n += k
            node = child
        log.debug(kv("insert", tokens=len(key), cached=n, new=len(key) - n))
        return n

    def commit(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor, node: TreeNode,
               tree_len: int) -> Committed:
        """Hand a request's computed KV to the tree and move its lock to the new end.

        Before: the caller holds a lock on `node`, which ends at `tree_len`; `slots[:tree_len]`
        are the tree's slots for `ids[:tree_len]`; the caller owns `slots[tree_len:]`.
        After: the tree owns all of `Committed.slots` (`[len(ids)]`; they replace the caller's
        `slots`), the caller holds a lock on `Committed.node` instead of `node`, and the caller's
        duplicates of tokens cached meanwhile by others were freed to the allocator.
        """
        key = as_ids(ids)
        if node.depth != tree_len or not 0 <= tree_len <= len(key):
            raise ValueError(
                f"commit: node ends at {node.depth}, tree_len={tree_len}, ids={len(key)}")
        p = self.insert(key, slots)
        assert p >= tree_len, "a locked prefix cannot have left the tree"
        dup = slots[tree_len:p]  # [p - tree_len] caller-owned duplicates
        self.allocator.free(dup)
        m = self.lookup(key)
        assert m.length == len(key)
        self.lock(m.node)
        self.unlock(node)
        return Committed(m.slots, m.node, p, dup.numel())

    def release(self, ids: Sequence[int] | torch.Tensor, slots: torch.Tensor, node: TreeNode,
                tree_len: int) -> int:
        """Finish a request: `commit`, then drop its lock. Returns `prefix_len`."""
        c = self.commit(ids, slots, node, tree_len)
        self.unlock(c.node)
        return c.prefix_len

    # -- locks --------------------------------------------------------------------------------

    def path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """`node` and its ancestors, root excluded; raises ValueError for an evicted handle."""
        path, x = [], node
        while x is not self.root:
            if x.parent is None:
                raise ValueError(f"{node!r} is not in the tree (evicted handle)")
            path.append(x)
            x = x.parent
        return path

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (ref-counted; pair with `unlock`)."""
        for x in self.path_to_root(node):
            if x.lock_ref == 0:
                self.evictable_size -= len(x.key)
                self.protected_size += len(x.key)
            x.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        path = self.path_to_root(node)
        if any(x.lock_ref <= 0 for x in path):
            raise ValueError(f"unlock of an unlocked node {node!r}")
        for x in path:
            x.lock_ref -= 1
            if x.lock_ref == 0:
                self.protected_size -= len(x.key)
                self.evictable_size += len(x.key)

    # -- eviction -----------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node except the root (pre-order)."""
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots by removing unlocked leaves, least recently used
        first (whole nodes, so it may free more). Returns the number freed, which is smaller
        than asked only when nothing evictable is left. `evict(0)` is a no-op."""
        if num_tokens <= 0:
            return 0
        heap = [(x.last_access, x.uid, x) for x in self.nodes()
                if not x.children and x.lock_ref == 0]
        heapq.heapify(heap)
        freed = nodes = 0
        while freed < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            if self.on_evict is not None:
                self.on_evict(x)
            self.allocator.free(x.value)
            freed += len(x.key)
            nodes += 1
            self.evictable_size -= len(x.key)
            parent = x.parent
            assert parent is not None
            del parent.children[x.key[0]]
            x.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        log.debug(kv("evict", want=num_tokens, freed=freed, nodes=nodes, left=self.total_size))
        return freed

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` caller-owned KV slots, evicting LRU leaves if the pool is short; None if even
        full eviction of unlocked nodes cannot make room (nothing is allocated then)."""
        short = n - self.allocator.num_free
        if short > 0:
            self.evict(short)
        return self.allocator.alloc(n)

    def stats(self) -> dict[str, int]:
        return {"kv_cached": self.total_size, "kv_evictable": self.evictable_size,
                "kv_protected": self.protected_size, "kv_free": self.allocator.num_free,
                "kv_slots": self.allocator.num_slots}
