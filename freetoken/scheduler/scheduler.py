"""Continuous batching over the hybrid radix cache.

Every step: admit waiting requests (prefix match, lock, working state), then build one mixed
batch — every decoding request's next token plus prefill chunks under a token budget, each
chunk ending at the next snapshot point so the recurrent state is captured exactly there.
KV slots are allocated per chunk; when the pool runs dry the newest request is preempted: its
computed prefix is committed to the tree and its working state donated as a snapshot, so it
resumes from where it stopped if nothing evicts them meanwhile.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.cache import HybridRadixCache, SlotAllocator, StatePool, create_policy
from freetoken.cache.policy import END
from freetoken.cache.tensors import StateTensors
from freetoken.log import get_logger, kv
from freetoken.scheduler.request import Request

log = get_logger("sched")


@dataclass
class BatchItem:
    req: Request
    n: int  # tokens fed this step
    wants_logits: bool


class Scheduler:
    def __init__(self, kv_slots: int, state_slots: int, state: StateTensors | None,
                 max_running: int = 4, chunk_tokens: int = 512, policy: str = "semantic"):
        self.kv_alloc = SlotAllocator(kv_slots)
        self.state_tensors = state
        self.policy = create_policy(policy)
        self.cache = HybridRadixCache(self.kv_alloc, StatePool(state_slots) if state else None,
                                      self.policy)
        self.max_running, self.chunk_tokens = max_running, chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

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
                r.aborted = True
                return True
        for r in self.running:
            if r.rid == rid:
                self._drop(r)
                self.running.remove(r)
                r.aborted = True
                log.info(kv("abort", rid=rid, computed=r.computed, generated=r.num_generated))
                return True
        return False

    def _admit(self, r: Request) -> bool:
        m = self.cache.match(r.ids)
        self.cache.lock(m.node)
        slot = None
        if self.state_tensors is not None:
            slot = self.cache.alloc_state()
            if slot is None:
                self.cache.unlock(m.node)
                return False
            if m.state_slot >= 0:
                self.state_tensors.copy(m.state_slot, slot)
            else:
                self.state_tensors.reset(slot)
        r.node, r.tree_len, r.computed, r.state_slot = m.node, m.length, m.length, slot
        r.row = m.kv_slots.clone()
        if r.num_generated == 0:
            r.cached_tokens, r.reuse_reason = m.length, m.reason
        points = self.policy.positions(r.prompt_len, r.req.anchors) if self.state_tensors else []
        r.snap_points = [(p, c) for p, c in points if p > m.length]
        log.info(kv("admit", rid=r.rid, prompt=r.prompt_len, reused=m.length, kv_match=m.kv_len,
                    state_from=m.state_len, state_cls=m.state_class, reason=m.reason,
                    snapshots=len(r.snap_points)))
        return True

    # -- releasing ---------------------------------------------------------------------------

    def _drop(self, r: Request) -> None:
        """Abort: free what the request owns, keep what the tree owns."""
        self.kv_alloc.free(r.row[r.tree_len:])
        self.cache.unlock(r.node)
        if r.state_slot is not None:
            assert self.cache.state_pool is not None
            self.cache.state_pool.free([r.state_slot])
        r.node, r.row, r.state_slot = None, torch.empty(0, dtype=torch.long), None

    def release(self, r: Request) -> None:
        """Finish or preempt: commit the computed prefix, donate the working state there."""
        n = r.computed
        rel = self.cache.release(r.ids[:n], r.row[:n], r.node, r.tree_len,
                                 r.state_slot if n > 0 else None, END)
        if r.state_slot is not None and not rel.snapshot_taken:
            assert self.cache.state_pool is not None
            self.cache.state_pool.free([r.state_slot])
        r.node, r.row, r.state_slot, r.tree_len = None, torch.empty(0, dtype=torch.long), None, 0

    def finish(self, r: Request) -> None:
        self.release(r)
        self.running.remove(r)

    def _preempt_newest(self, keep: set[int]) -> bool:
        for r in reversed(self.running):
            if id(r) not in keep:
                log.info(
                    kv("preempt", rid=r.rid, computed=r.computed, kv_free=self.kv_alloc.num_free)
                )
                self.release(r)
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

    def schedule(self) -> list[BatchItem]:
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            sib = self._sibling_ahead(r)
            if sib is not None:
                if r.waiting_for != sib.rid:
                    r.waiting_for = sib.rid
                    log.info(kv("wait_for_sibling", rid=r.rid, sibling=sib.rid,
                                sibling_computed=sib.computed))
                break
            if not self._admit(r):
                break
            self.waiting.popleft()
            self.running.append(r)
        items: list[BatchItem] = []
        budget = self.chunk_tokens
        for r in sorted(self.running, key=lambda r: r.remaining != 1):  # decodes first
            if not any(x is r for x in self.running):
                continue  # preempted by an allocation earlier in this loop
            if r.remaining == 1:
                n = 1
            else:
                n = min(r.next_stop(), r.computed + budget, len(r.ids)) - r.computed
                if n <= 0:
                    continue
            slots = self._alloc(n, {id(i.req) for i in items} | {id(r)})
            if slots is None:
                if r.remaining == 1:
                    continue
                break
            r.row = torch.cat([r.row, slots])
            items.append(BatchItem(r, n, r.computed + n == len(r.ids)))
            budget -= n
        return items

    def _alloc(self, n: int, keep: set[int]) -> torch.Tensor | None:
        while True:
            slots = self.cache.alloc_kv(n)
            if slots is not None or not self._preempt_newest(keep):
                return slots

    def after_forward(self, item: BatchItem) -> None:
        """Advance `computed`; take a snapshot if the chunk ended at a snapshot point."""
        r = item.req
        r.computed += item.n
        if self.state_tensors is None and item.n > 1:
            # attention-only models can share KV at any prefix: publish each prefill chunk
            c = self.cache.commit(r.ids[:r.computed], r.row[:r.computed], r.node, r.tree_len)
            r.row, r.node, r.tree_len = c.slots, c.node, r.computed
        while r.snap_points and r.snap_points[0][0] <= r.computed:
            p, cls = r.snap_points.pop(0)
            if p == r.computed:
                self._snapshot(r, p, cls)

    def _snapshot(self, r: Request, p: int, cls: str) -> None:
        assert self.state_tensors is not None and r.state_slot is not None
        c = self.cache.commit(r.ids[:p], r.row[:p], r.node, r.tree_len)
        r.row, r.node, r.tree_len = torch.cat([c.slots, r.row[p:]]), c.node, p
        slot = self.cache.alloc_state()
        if slot is None:
            log.info(kv("snapshot_skip", rid=r.rid, pos=p, cls=cls, why="state_pool_full"))
            return
        self.state_tensors.copy(r.state_slot, slot)
        if not self.cache.attach_snapshot(c.node, slot, cls):
            assert self.cache.state_pool is not None
            self.cache.state_pool.free([slot])

    def stats(self) -> dict:
        s = dict(self.cache.stats())
        s.update(running=len(self.running), waiting=len(self.waiting),
                 kv_used=self.kv_alloc.num_used, kv_total=self.kv_alloc.num_slots)
        return s
