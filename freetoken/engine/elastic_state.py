"""Elastic VRAM's third buffer: the device recurrent-state pool, resized at a safe point.

`resize_states(core, n)` gives the engine a device state pool of `n` slots (plus the decode
runner's scratch slot) without losing a running request's state: the cache decides which
snapshots leave and where every kept slot goes (cache/state_resize.py: the cache's own eviction
rule, spills to the host tier, compaction below `n`); this module owns the tensors. Order, so
that a failure changes nothing: check (pure), allocate the new `StateTensors` (a seam tests
make fail), then let the cache evict and compact, run the spills on the old tensors, copy every
kept slot into the new ones, relabel the running requests' working slots, swap the tensors in
(`Caches`, `CacheOps`) and tell the decode runner (`DecodeRunner.rebind_state`: its scratch
slot moved and its graphs captured the old tensors). The host tier keeps its size.

Shapes: conv[l] [N, conv_dim, K-1], ssm[l] [N, Hv, dk, dv]; M moved slots.
"""
from __future__ import annotations

import torch

from freetoken.cache.state_resize import (
    device_snapshots,
    resize_device_states,
    state_resize_check,
)
from freetoken.cache.tensors import StateTensors
from freetoken.experts.runtime import ResizeError
from freetoken.log import get_logger, kv

log = get_logger("vram")
_OOM = (torch.OutOfMemoryError, RuntimeError)


def new_state_tensors(cfg, num_slots: int, dtype: torch.dtype,
                      device: torch.device) -> StateTensors:
    """The state allocation of a rebuild (a seam: tests inject an allocation failure)."""
    return StateTensors(cfg, num_slots, dtype, device)


def state_slots(core) -> int:
    """The device state pool's size (0 for a model without recurrent state)."""
    pool = core.sched.cache.state_pool
    return pool.num_slots if pool is not None else 0


def state_live(core) -> int:
    """State slots that must stay: running requests' working states and pinned snapshots."""
    cache = core.sched.cache
    if cache.state_pool is None:
        return 0
    return (sum(r.state_slot is not None for r in core.sched.running)
            + device_snapshots(cache)[0])


def resize_states(core, n: int) -> None:
    """Re-allocate `core`'s device state pool for `n` slots at a safe point (see the module
    docstring). Raises `ResizeError` with the old pool serving when `n` cannot hold the live
    states or the allocation fails."""
    sched, caches = core.sched, core.caches
    cache = sched.cache
    old_t = caches.state
    old = state_slots(core)
    if old_t is None:
        raise ResizeError("this model has no recurrent state; nothing to resize")
    core.cache_ops.run(cache.take_ops())  # anything decided before (none at a safe point)
    working = [r.state_slot for r in sched.running if r.state_slot is not None]
    why = state_resize_check(cache, n, working)
    if why is not None:
        raise ResizeError(f"{why}; still serving with {old} state slots")
    try:
        new_t = new_state_tensors(core.cfg, n + 1, core.dtype, core.device)
    except _OOM as e:
        log.warning(kv("state_alloc_failed", old=old, asked=n, error=type(e).__name__))
        raise ResizeError(f"could not allocate a state pool of {n} slots ({e}); "
                          f"still serving with {old}") from None
    res = resize_device_states(cache, n, working)
    core.cache_ops.run(res.ops)  # spills read the old device tensors
    keep = min(old, n)
    s_d, d_d = res.src.to(core.device), res.dst.to(core.device)
    for new, cur in zip(new_t.conv + new_t.ssm, old_t.conv + old_t.ssm):
        new[:keep] = cur[:keep]
        if res.src.numel():
            new[d_d] = cur[s_d]
    for r in sched.running:
        if r.state_slot is not None:
            r.state_slot = res.relabel(r.state_slot)
    caches.state = new_t
    core.cache_ops.state = new_t
    if core.runner is not None:
        core.runner.rebind_state(n)
    log.info(kv("state_resized", old=old, new=n, moved=int(res.src.numel()),
                spilled=res.spilled, dropped=res.dropped, working=len(working),
                mb=StateTensors.bytes_per_slot(core.cfg, core.dtype) * n // 2**20))
