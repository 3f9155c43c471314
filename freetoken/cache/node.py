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
