"""Radix tree node and the token-id helpers shared by the radix caches."""
from __future__ import annotations

from collections.abc import Sequence

import torch


class TreeNode:
    """One radix edge. `depth` is the prefix length at the end of this node (root: 0)."""

    __slots__ = ("children", "depth", "key", "last_access", "lock_ref", "parent", "uid", "value")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, depth: int,
                 uid: int, now: int) -> None:
        self.key = key
        self.value = value  # [len(key)] KV slots
        self.children: dict[int, TreeNode] = {}
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.lock_ref = 0  # number of locks on this node or on any descendant
        self.last_access = now
        self.uid = uid
        self.depth = depth

    def __repr__(self) -> str:
        return (f"TreeNode(uid={self.uid}, depth={self.depth}, len={len(self.key)}, "
                f"lock={self.lock_ref})")


class Pins:
    """Nodes pinned by locks, counted: a node locked twice stays pinned until its second
    unlock. The snapshot tiers and the kept logits never move what is pinned (`in`)."""

    def __init__(self) -> None:
        self._count: dict[TreeNode, int] = {}

    def add(self, node: TreeNode) -> None:
        self._count[node] = self._count.get(node, 0) + 1

    def remove(self, node: TreeNode) -> None:
        left = self._count[node] - 1
        if left:
            self._count[node] = left
        else:
            del self._count[node]

    def __contains__(self, node: object) -> bool:
        return node in self._count


def as_ids(ids: Sequence[int] | torch.Tensor) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


def common_len(edge: list[int], key: list[int], off: int) -> int:
    """Length of the common prefix of `edge` and `key[off:]`."""
    m = min(len(edge), len(key) - off)
    if edge[:m] == key[off : off + m]:  # one C-level compare for the common full-edge case
        return m
    j = 0
    while j < m:  # chunked slice compares keep long prompts out of a per-token Python loop
        e = min(j + 64, m)
        if edge[j:e] != key[off + j : off + e]:
            while edge[j] == key[off + j]:
                j += 1
            return j
        j = e
    return m
