"""Slot allocator for the paged KV pool (page size 1).

One slot holds one token's K and V across every full-attention layer, as in sglang's radix
cache: the engine owns the `[num_slots, ...]` KV tensors and indexes them with the slot ids this
allocator hands out. The allocator only does bookkeeping and never touches a device tensor.

Ownership: `alloc` hands slots to the caller; the caller owns them until it passes them to
`free` or hands them to a cache (e.g. `RadixCache.insert`, whose docstring says exactly which
slots it takes). Freeing a slot that is not allocated (double free, out of range, duplicate in
one call) raises `ValueError` at once instead of corrupting the pool.
"""
from __future__ import annotations

import torch

from freetoken.log import get_logger, kv

log = get_logger("cache")


class SlotAllocator:
    """Free-list bookkeeping over `num_slots` integer slot ids `0..num_slots-1`.

    `alloc(n)` is all-or-nothing: it returns exactly `n` distinct free slots, or `None` when
    fewer than `n` are free (it never hands out a partial allocation). Slots come back in
    low-id-first order after construction; after frees the order is unspecified.
    """

    kind = "kv"

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # _free[:_num_free] are the free slots (a stack); _used[s] is True while s is allocated.
        self._free = torch.arange(num_slots, dtype=torch.long)  # [S]
        self._num_free = num_slots
        self._used = torch.zeros(num_slots, dtype=torch.bool)  # [S]

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return `n` free slots as a LongTensor `[n]` now owned by the caller, or `None`."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._num_free:
            log.debug(kv("alloc_fail", pool=self.kind, want=n, free=self._num_free))
            return None
        start = self._num_free - n
        out = self._free[start : self._num_free].clone()  # [n]
        self._num_free = start
        self._used[out] = True
        return out

    def free(self, slots: torch.Tensor | list[int]) -> None:
        """Return `slots` (owned by the caller) to the pool. Empty input is a no-op."""
        t = torch.as_tensor(slots, dtype=torch.long).reshape(-1)  # [n]
        n = t.numel()
        if n == 0:
            return
        if int(t.min()) < 0 or int(t.max()) >= self.num_slots:
            raise ValueError(f"{self.kind} slot out of range [0, {self.num_slots}): {t.tolist()}")
        if torch.unique(t).numel() != n:
            raise ValueError(f"duplicate {self.kind} slots in one free: {t.tolist()}")
        if not bool(self._used[t].all()):
            bad = t[~self._used[t]].tolist()
            raise ValueError(f"double free of {self.kind} slots {bad}")
        self._used[t] = False
        self._free[self._num_free : self._num_free + n] = t
        self._num_free += n

    def is_free(self, slot: int) -> bool:
        return not bool(self._used[slot])

    def free_slots(self) -> list[int]:
        """The free slots, for invariant checks and debugging (O(num_slots))."""
        return self._free[: self._num_free].tolist()

    def compaction(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The moves that make every allocated slot fit below `num_slots`: `(src [M], dst [M])`,
        each used slot `>= num_slots` paired with a free slot `< num_slots` (empty when growing
        or when nothing sits above). Pure: nothing changes. Raises `ValueError` when more slots
        are in use than `num_slots` holds."""
        if num_slots < self.num_used:
            raise ValueError(f"{self.num_used} {self.kind} slots are in use; "
                             f"{num_slots} cannot hold them")
        if num_slots >= self.num_slots:
            return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
        src = torch.nonzero(self._used[num_slots:]).reshape(-1) + num_slots  # [M]
        dst = torch.nonzero(~self._used[:num_slots]).reshape(-1)[: src.numel()]  # [M]
        return src, dst

    def resize(self, num_slots: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Become a pool of `num_slots` slots after the owner moved `src -> dst` (the moves
        `compaction(num_slots)` returned; the caller relabels every slot id it holds). The
        allocated set stays the same size; the free list is rebuilt in id order."""
        used = self._used.clone()
        used[src] = False
        used[dst] = True
        if num_slots < self.num_slots and bool(used[num_slots:].any()):
            raise ValueError("resize: slots above the new size are still in use")
        new_used = torch.zeros(num_slots, dtype=torch.bool)
        keep = min(num_slots, self.num_slots)
        new_used[:keep] = used[:keep]
        free = torch.nonzero(~new_used).reshape(-1)  # ascending, as after construction
        self.num_slots = num_slots
        self._used = new_used
        self._free = torch.empty(num_slots, dtype=torch.long)
        self._free[: free.numel()] = free
        self._num_free = free.numel()
