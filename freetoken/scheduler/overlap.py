"""The overlapped decode step: which requests surely decode once more while a step is in flight.

`EngineCore` leaves a decode-only step in flight and launches the one after it before reading
its tokens (see freetoken/engine/core.py). That next step is planned here, as every other step
is by `Scheduler.schedule`: it is certain up to stop tokens when every running request is a row
of the step in flight and goes on decoding, no waiting request could be admitted now (the batch
is full), and the KV pool has a slot for each without preempting. A request that the step in
flight ends by length is left out. The plan owns the KV slots it allocated until the step is
launched; `rollback` gives them back when it is not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.scheduler.finish import ends_by_length_next
from freetoken.scheduler.plan import BatchItem
from freetoken.scheduler.scheduler import Scheduler


@dataclass
class AheadPlan:
    """The step after the one in flight: its items (one decode row each, feeding the position
    after the one the step in flight feeds) and, per item, its row in the step in flight,
    whose sampled id becomes its input on the device (`chain`)."""

    items: list[BatchItem]
    chain: list[int]

    def rollback(self, sched: Scheduler) -> None:
        """Not launched: give the KV slots back (the next step is scheduled as usual)."""
        for it in self.items:
            r = it.req
            sched.kv_alloc.free(r.row[-1:])
            r.row = r.row[:-1]


def schedule_ahead(sched: Scheduler, in_flight: list[BatchItem], max_context: int
                   ) -> AheadPlan | None:
    """Plan the decode step after `in_flight` (see the module docstring), its KV allocated;
    None when it is not certain or the pool has no slot for each."""
    if sched.waiting and len(sched.running) < sched.max_running:
        return None  # someone could be admitted now (a full batch keeps overlapping)
    running = {id(r) for r in sched.running}
    rows_of = {id(it.req): i for i, it in enumerate(in_flight)}
    if not running or any(k not in rows_of for k in running):
        return None
    ahead = [(it.req, rows_of[id(it.req)]) for it in in_flight
             if id(it.req) in running and it.n == 1 and not ends_by_length_next(it.req,
                                                                                max_context)]
    if not ahead:
        return None
    slots = sched.cache.alloc_kv(len(ahead))
    if slots is None:
        return None
    items = []
    for i, (r, _) in enumerate(ahead):
        r.row = torch.cat([r.row, slots[i:i + 1]])
        pos = r.computed + 1  # the step in flight feeds position r.computed
        items.append(BatchItem(r, 1, True, pos, None, r.row[:pos + 1]))
    return AheadPlan(items, [j for _, j in ahead])
