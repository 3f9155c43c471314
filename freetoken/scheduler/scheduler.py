"""Continuous batching over the hybrid-state radix cache.

Every step: admit waiting requests (prefix match, lock, working state), then build one mixed
batch — every decoding request's next token (always served, outside the budget) plus prefill
chunks under a shared token budget, each chunk ending at the next snapshot point so the
recurrent state is captured exactly there.

The scheduler decides and the engine executes: `schedule()` returns a `StepPlan` (rows with
their token ids, positions and KV slots; the state ops to run before the forward — loading
each admitted request's resume state, spills the admission caused — and after it — copying
working states into snapshot slots, spills those allocations caused). Nothing here touches a
tensor on the compute device; `after_forward` only updates bookkeeping.

Fair prefill: the budget is water-filled over the prefilling requests, smallest need first, so
a short prompt admitted beside a 200k-token one gets its whole (next) chunk at once and its
first token within a few steps, while the long one takes what is left.
KV slots are allocated per chunk; when the pool runs dry the newest request is preempted: its
computed prefix is committed to the tree and its working state donated as a snapshot, so it
resumes from where it stopped if nothing evicts them meanwhile.

What each request holds in the cache (its match, KV row, working state, the snapshots and
kept logits its chunks take) is `CacheManager`'s (cache_manager.py); the plan's types and the
budget's split are in plan.py.

Siblings (sub-agents fanned out together): a waiting request whose prompt shares a long prefix
with a running request's prefill still to compute waits until that sibling has passed it, then
reuses it. It waits alone: it keeps its place at the front of the queue and the requests behind
it are admitted around it, so an unrelated request's first token is at most one step later
than without the waiting sibling.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from freetoken.log import get_logger, kv
from freetoken.scheduler.cache_manager import CacheManager
from freetoken.scheduler.plan import BatchItem, StepPlan, water_fill
from freetoken.scheduler.request import Request

__all__ = ["BatchItem", "Scheduler", "StepPlan"]
log = get_logger("sched")


class Scheduler:
    def __init__(self, kv_slots: int, state_slots: int, has_state: bool,
                 max_running: int = 4, chunk_tokens: int = 512, policy: str = "semantic",
                 host_slots: int = 0, eviction: str = "value", logits_slots: int = 0):
        self.cm = CacheManager(kv_slots, state_slots, has_state, chunk_tokens, policy,
                               host_slots, eviction, logits_slots)
        self.has_state = has_state  # the model has linear-attention layers (a state pool)
        self.cache, self.kv_alloc, self.policy = self.cm.cache, self.cm.kv_alloc, self.cm.policy
        self.reuse = self.cm.reuse  # why prompts resumed short of their KV match, counted
        self.max_running, self.chunk_tokens = max_running, chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # requests of a failed batch, re-run alone (`retry_alone`): id(request) -> the position
        # the request must have computed past before it is batched with others again
        self.alone: dict[int, int] = {}

    # -- queue management ------------------------------------------------------------------

    def add(self, r: Request) -> None:
        r.ids = list(r.req.input_ids)
        r.prompt_len = len(r.ids)
        self.waiting.append(r)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: str) -> bool:
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
                self.alone.pop(id(r), None)
                r.aborted = True
                return True
        for r in self.running:
            if r.rid == rid:
                if r.num_generated == 0 and r.computed > r.tree_len:
                    # a cancelled prefill (a client that gave up, e.g. Claude Code after 300 s
                    # without a byte, then re-sends it): keep its completed chunks, as a
                    # preemption does, so the re-sent prompt resumes there
                    self.cm.release(r)
                else:
                    self.cm.drop(r)
                self.running.remove(r)
                self.cm.end_lineage(r)
                self.alone.pop(id(r), None)
                r.aborted = True
                log.info(kv("abort", rid=rid, computed=r.computed, generated=r.num_generated))
                return True
        return False

    # -- releasing ---------------------------------------------------------------------------

    def finish(self, r: Request) -> None:
        self.cm.release(r)
        self.running.remove(r)
        self.cm.end_lineage(r)
        self.alone.pop(id(r), None)

    def retry_alone(self, r: Request, until: int) -> None:
        """A forward pass with rows of `r` failed: its working state and this step's KV may be
        half written, so both are dropped (the tree keeps what it owns, as an abort does) and
        `r` waits at the front of the queue to recompute from its cached prefix, admitted only
        into an empty batch and batched with no one until it has computed `ids[:until]`: a
        failure that follows it there is its own (engine/isolation.py)."""
        self.cm.drop(r)
        r.computed = r.tree_len = 0
        self.running.remove(r)
        self.waiting.appendleft(r)
        self.alone[id(r)] = until

    def _preempt_newest(self, keep: set[int]) -> bool:
        for r in reversed(self.running):
            if id(r) not in keep:
                log.info(
                    kv("preempt", rid=r.rid, computed=r.computed, kv_free=self.kv_alloc.num_free)
                )
                self.cm.release(r)
                r.computed = 0
                self.running.remove(r)
                self.waiting.appendleft(r)
                return True
        return False

    # -- one step ----------------------------------------------------------------------------

    # A waiting request whose prompt shares at least this many tokens with a running request's
    # not-yet-computed prefill waits for it (sub-agent siblings fanned out together).
    SIBLING_MIN_SHARED = 256

    def _sibling_ahead(self, r: Request) -> Request | None:
        """A running request still prefilling a long prefix `r` shares: admitting `r` now would
        compute that prefix twice; once the sibling has passed it (and committed its KV and a
        snapshot there), `r` reuses it."""
        for o in self.running:
            if o.computed >= o.prompt_len - 1:
                continue
            n = min(r.prompt_len, o.prompt_len)
            diff = np.flatnonzero(r.prompt_array[:n] != o.prompt_array[:n])
            shared = int(diff[0]) if diff.size else n
            if shared >= self.SIBLING_MIN_SHARED and o.computed < shared - 1:
                return o
        return None

    def _admit_waiting(self) -> None:
        """Admit in arrival order, around the requests that wait for a sibling: a waiting
        sibling keeps its place in the queue but blocks nobody behind it (#23: an unrelated
        request waited 9.6 s instead of 1.75 s behind one)."""
        held: list[Request] = []
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            if self.alone and (any(id(o) in self.alone for o in self.running)
                               or (id(r) in self.alone and self.running)):
                break  # a request re-run alone (retry_alone) runs, or waits for an empty batch
            sib = self._sibling_ahead(r)
            if sib is not None:
                if r.waiting_for != sib.rid:
                    r.waiting_for = sib.rid
                    log.info(kv("wait_for_sibling", rid=r.rid, sibling=sib.rid,
                                sibling_computed=sib.computed, queued=len(self.waiting) - 1))
                held.append(self.waiting.popleft())
                continue
            if not self.cm.admit(r):
                break
            self.waiting.popleft()
            self.running.append(r)
            if id(r) in self.alone:
                break
        self.waiting.extendleft(reversed(held))  # back at the front, in their order

    def _shares(self) -> dict[int, int]:
        """Prefill tokens per request this step: water-filling of the chunk budget, smallest
        need first (each need ends at the request's next snapshot point)."""
        return water_fill([(r.next_stop() - r.computed, id(r)) for r in self.running
                           if r.remaining > 1], self.chunk_tokens)

    def schedule(self) -> StepPlan:
        self._admit_waiting()
        pre_ops = self.cache.take_ops()
        shares = self._shares()
        items: list[BatchItem] = []
        for r in sorted(self.running, key=lambda r: r.remaining != 1):  # decodes first
            if not any(x is r for x in self.running):
                continue  # preempted by an allocation earlier in this loop
            if r.remaining == 0:  # the whole prompt cached with its logits: nothing to feed
                items.append(BatchItem(r, 0, True, r.computed, [], r.row[:r.computed],
                                       logits_from=r.logits_from))
                continue
            n = 1 if r.remaining == 1 else shares.get(id(r), 0)
            if n <= 0:
                continue
            slots = self._alloc(n, {id(i.req) for i in items} | {id(r)})
            if slots is None:
                if r.remaining == 1:
                    continue
                break
            r.row = torch.cat([r.row, slots])
            end = r.computed + n
            snap = self.cm.plan_snapshot(r, end)
            items.append(BatchItem(r, n, end == len(r.ids), r.computed, r.ids[r.computed:end],
                                   r.row[:end], snap, self.cm.plan_logits(r, end, snap)))
        return StepPlan(items, pre_ops, self.cache.take_ops())

    def _alloc(self, n: int, keep: set[int]) -> torch.Tensor | None:
        while True:
            slots = self.cache.alloc_kv(n)
            if slots is not None or not self._preempt_newest(keep):
                return slots

    def discard(self, items: list[BatchItem]) -> None:
        """A planned step failed: give back the slots its snapshots and kept logits were to
        take (`CacheManager.discard`)."""
        self.cm.discard(items)

    def after_forward(self, item: BatchItem) -> None:
        """Advance `computed`; publish the chunk and attach the snapshot the plan copied
        (`CacheManager.advance`; bookkeeping only)."""
        r = item.req
        r.computed += item.n
        if self.alone.get(id(r), r.computed + 1) <= r.computed:
            del self.alone[id(r)]  # past the failed step: it is batched again
        self.cm.advance(item)

    def stats(self) -> dict:
        return dict(self.cm.stats(), running=len(self.running), waiting=len(self.waiting))
