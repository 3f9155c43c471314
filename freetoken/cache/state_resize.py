"""Resizing the device state pool of a hybrid radix cache (elastic VRAM, engine/elastic.py).

The device pool's slots hold two kinds of state: running requests' *working* slots (the caller
names them: the cache does not know requests) and device-tier snapshots. A resize to `n` slots
keeps every working slot and every pinned snapshot (a locked node's: a request will load it);
when more slots are in use than `n` holds, unpinned device snapshots leave by the cache's own
eviction rule (`SnapshotTiers.evict_device`: lowest value first, each spilled to the host tier
when it has room worth giving, else dropped), exactly as a full pool makes room for one more.
Then every used slot at or above `n` moves to a free slot below it (`StatePool.compaction`),
the snapshots on moved slots are relabelled here and the caller relabels its working slots
with `StateResize.relabel`.

All or nothing: `state_resize_check` says, without changing anything, whether `n` can hold
what must stay; `resize_device_states` checks first and raises `ValueError` before any change.
The state *tensors* are the engine's: it allocates the new ones before calling (so a failed
allocation changes nothing), runs `ops` (the spills, which read the old device tensors), then
copies `[0, min(old, n))` and `src -> dst` into the new ones.

Shapes: M moved slots.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from freetoken.cache.hybrid import HybridRadixCache
from freetoken.cache.snapshots import DEVICE, StateOp
from freetoken.log import get_logger, kv

log = get_logger("cache")


class StateResize(NamedTuple):
    """What a device state pool resize did: `ops` (spills, in order, to run on the old device
    tensors before the copy), `src`/`dst` ([M] each: the state at old slot src[i] now lives at
    dst[i]), and how many snapshots left the device tier (`spilled` to the host, `dropped`:
    gone, no host room worth giving)."""

    old: int
    new: int
    ops: list[StateOp]
    src: torch.Tensor  # [M]
    dst: torch.Tensor  # [M]
    spilled: int
    dropped: int

    def relabel(self, slot: int) -> int:
        """The slot id `slot` (of the old pool) has in the new one."""
        hit = (self.src == slot).nonzero()
        return int(self.dst[hit[0, 0]]) if hit.numel() else slot


def device_snapshots(cache: HybridRadixCache) -> tuple[int, int]:
    """(pinned, unpinned) snapshots of the device tier."""
    pinned = unpinned = 0
    for node, s in cache.tiers.snaps.items():
        if s.tier == DEVICE:
            if node in cache._pins:
                pinned += 1
            else:
                unpinned += 1
    return pinned, unpinned


def state_resize_check(cache: HybridRadixCache, n: int, working: Sequence[int]) -> str | None:
    """Why the device state pool cannot become `n` slots (None: it can). Pure."""
    pool = cache.state_pool
    if pool is None:
        return "the model has no recurrent state"
    if n < 1:
        return f"the state pool needs at least 1 slot (got {n})"
    pinned, unpinned = device_snapshots(cache)
    keep = pool.num_used - unpinned
    if keep != len(working) + pinned:  # a slot held by someone the caller did not name
        return (f"{keep - len(working) - pinned} state slots are held by neither a running "
                f"request nor a snapshot; not resizing")
    if n < keep:
        return (f"{len(working)} running requests' states and {pinned} pinned snapshots need "
                f"{keep} state slots; {n} cannot hold them")
    return None


def resize_device_states(cache: HybridRadixCache, n: int, working: Sequence[int]) -> StateResize:
    """Make the cache's device state pool `n` slots (see the module docstring). `working`:
    the device slots running requests own. Raises `ValueError` (nothing changed) when `n`
    cannot hold them and the pinned snapshots."""
    why = state_resize_check(cache, n, working)
    if why is not None:
        raise ValueError(why)
    pool, tiers = cache.state_pool, cache.tiers
    assert pool is not None
    old = pool.num_slots
    pending = cache.take_ops()  # (none at a safe point; kept in order if there are)
    spilled0, evicted0 = (tiers.counters[k] for k in ("snapshots_spilled", "snapshots_evicted"))
    on_device = sum(device_snapshots(cache))
    over = pool.num_used - n
    if over > 0:
        freed = cache.evict_states(over)
        assert freed == over, (freed, over)  # the check counted what may not leave
    ops = pending + cache.take_ops()
    spilled = tiers.counters["snapshots_spilled"] - spilled0
    dropped = on_device - sum(device_snapshots(cache)) - spilled
    # host snapshots dropped to make room for a spill of more value
    host_dropped = tiers.counters["snapshots_evicted"] - evicted0 - dropped
    src, dst = pool.compaction(n)  # [M], [M]
    if src.numel():
        at = {int(s): int(d) for s, d in zip(src.tolist(), dst.tolist())}
        for s in tiers.snaps.values():
            if s.tier == DEVICE and s.slot in at:
                s.slot = at[s.slot]
    pool.resize(n, src, dst)
    log.info(kv("state_pool_resize", old=old, new=n, working=len(working), moved=src.numel(),
                spilled=spilled, dropped=dropped, host_dropped=host_dropped,
                snapshots=sum(device_snapshots(cache))))
    return StateResize(old, n, ops, src, dst, spilled, dropped)
