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

Kept logits (hybrid models, `cache/logits.py`): the prompt chunks ending at `prompt_len - 1`
and `prompt_len` keep their last row's logits beside the snapshot there (the scheduler adds the
`prompt_len` snapshot point); a prompt whose whole length matches such a node is admitted with
nothing to feed, and its first step is a row of 0 tokens that samples from the kept logits.

Siblings (sub-agents fanned out together): a waiting request whose prompt shares a long prefix
with a running request's prefill still to compute waits until that sibling has passed it, then
reuses it. It waits alone: it keeps its place at the front of the queue and the requests behind
it are admitted around it, so an unrelated request's first token is at most one step later
than without the waiting sibling.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.cache import HybridRadixCache, SlotAllocator, StateOp, StatePool, create_policy
from freetoken.cache.policy import END
from freetoken.log import get_logger, kv
from freetoken.scheduler.request import Request

log = get_logger("sched")


@dataclass
class BatchItem:
    """One sequence's rows this step: `token_ids` at positions `[start, start + n)`, whose KV
    goes to `kv_slots[start:]` (`kv_slots[:start]` hold the cached prefix)."""

    req: Request
    n: int  # tokens fed this step
    wants_logits: bool
    start: int = 0
    token_ids: list[int] | None = None
    kv_slots: torch.Tensor | None = None  # [start + n]
    snapshot: tuple[int, str, int] | None = None  # (position, class, fresh state slot)
    keep_logits: int | None = None  # kept-logits slot the engine writes this item's last row to
    logits_from: int | None = None  # n == 0: the kept row its first token is sampled from


@dataclass
class StepPlan:
    """What the engine carries out this step, in order: `pre_ops`, the forward of `items`,
    `post_ops`, then `after_forward` per item."""

    items: list[BatchItem]
    pre_ops: list[StateOp]
    post_ops: list[StateOp]


class Scheduler:
    def __init__(self, kv_slots: int, state_slots: int, has_state: bool,
                 max_running: int = 4, chunk_tokens: int = 512, policy: str = "semantic",
                 host_slots: int = 0, eviction: str = "value", logits_slots: int = 0):
        self.kv_alloc = SlotAllocator(kv_slots)
        self.has_state = has_state  # the model has linear-attention layers (a state pool)
        # interval snapshots no finer than a prefill chunk: each chunk ends at a snapshot
        # point, and with layer streaming every chunk costs a pass of the experts over the link
        self.policy = create_policy(policy, **({"fill_every": max(4096, chunk_tokens)}
                                               if policy == "semantic" else {}))
        self.cache = HybridRadixCache(self.kv_alloc, StatePool(state_slots) if has_state else None,
                                      self.policy,
                                      StatePool(host_slots) if has_state and host_slots else None,
                                      eviction, logits_slots=logits_slots)
        self.max_running, self.chunk_tokens = max_running, chunk_tokens
        self.reuse: dict[str, int] = {}  # why prompts resumed short of their KV match, counted
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
                    self.release(r)
                else:
                    self._drop(r)
                self.running.remove(r)
                self._end_lineage(r)
                self.alone.pop(id(r), None)
                r.aborted = True
                log.info(kv("abort", rid=rid, computed=r.computed, generated=r.num_generated))
                return True
        return False

    @property
    def keeps_logits(self) -> bool:
        """Whether prompts keep their last logits rows (`cache/logits.py`)."""
        return self.cache.logits.pool.num_slots > 0

    def user(self, r: Request) -> str:
        """Who shares a snapshot: the session key, else the request itself."""
        return r.req.session_key or r.rid

    def _admit(self, r: Request) -> bool:
        m = self.cache.match(r.ids, self.user(r))
        self.cache.lock(m.node)
        slot = None
        if self.has_state:
            slot = self.cache.alloc_state()
            if slot is None:
                self.cache.unlock(m.node)
                return False
            self.cache.load_state(m, slot)
        r.node, r.tree_len, r.computed, r.state_slot = m.node, m.length, m.length, slot
        if not r.in_lineage:  # once per request: a preempted one is re-admitted, not new
            r.in_lineage = True
            self.cache.begin(self.user(r), r.req.parent_key, m)
        r.row = m.kv_slots.clone()
        if r.num_generated == 0:
            r.cached_tokens, r.reuse_reason = m.length, m.reason
            r.kv_match, r.state_tier, r.lost = m.kv_len, m.state_tier, m.lost
            why = m.reason.split("=")[0] + (f"({m.lost.split('@')[0]})" if m.lost else "")
            tier = f"resumed_{m.state_tier or 'none'}"
            for k in (why, tier):
                self.reuse[k] = self.reuse.get(k, 0) + 1
        points = self.policy.positions(r.prompt_len, r.req.anchors) if self.has_state else []
        if self.keeps_logits and r.num_generated == 0:
            points.append((r.prompt_len, END))  # the state beside the prompt's kept logits
        r.snap_points = [(p, c) for p, c in points if p > m.length]
        r.logits_from = m.logits_slot if m.logits_slot >= 0 else None
        log.info(kv("admit", rid=r.rid, prompt=r.prompt_len, reused=m.length, kv_match=m.kv_len,
                    state_from=m.state_len, state_cls=m.state_class, tier=m.state_tier,
                    reason=m.reason, lost=m.lost or None, snapshots=len(r.snap_points)))
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
                                 r.state_slot if n > 0 else None, END, self.user(r))
        if r.state_slot is not None and not rel.snapshot_taken:
            assert self.cache.state_pool is not None
            self.cache.state_pool.free([r.state_slot])
        r.node, r.row, r.state_slot, r.tree_len = None, torch.empty(0, dtype=torch.long), None, 0

    def finish(self, r: Request) -> None:
        self.release(r)
        self.running.remove(r)
        self._end_lineage(r)
        self.alone.pop(id(r), None)

    def retry_alone(self, r: Request, until: int) -> None:
        """A forward pass with rows of `r` failed: its working state and this step's KV may be
        half written, so both are dropped (the tree keeps what it owns, as an abort does) and
        `r` waits at the front of the queue to recompute from its cached prefix, admitted only
        into an empty batch and batched with no one until it has computed `ids[:until]`: a
        failure that follows it there is its own (engine/isolation.py)."""
        self._drop(r)
        r.computed = r.tree_len = 0
        self.running.remove(r)
        self.waiting.appendleft(r)
        self.alone[id(r)] = until

    def _end_lineage(self, r: Request) -> None:
        if r.in_lineage:
            r.in_lineage = False
            self.cache.end(self.user(r))

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
            if not self._admit(r):
                break
            self.waiting.popleft()
            self.running.append(r)
            if id(r) in self.alone:
                break
        self.waiting.extendleft(reversed(held))  # back at the front, in their order

    def _shares(self) -> dict[int, int]:
        """Prefill tokens per request this step: water-filling of the chunk budget, smallest
        need first (each need ends at the request's next snapshot point)."""
        need = sorted(((r.next_stop() - r.computed, id(r)) for r in self.running
                       if r.remaining > 1), key=lambda x: x[0])
        out, left = {}, self.chunk_tokens
        for i, (want, key) in enumerate(need):
            give = min(want, max(left // (len(need) - i), 1))
            out[key] = give
            left = max(left - give, 0)
        return out

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
            snap = self._plan_snapshot(r, end)
            items.append(BatchItem(r, n, end == len(r.ids), r.computed, r.ids[r.computed:end],
                                   r.row[:end], snap, self._plan_logits(r, end, snap)))
        return StepPlan(items, pre_ops, self.cache.take_ops())

    def _plan_logits(self, r: Request, end: int, snap: tuple | None) -> int | None:
        """A kept-logits slot for a prompt chunk ending at `prompt_len - 1` or `prompt_len`
        with a snapshot planned there (`cache/logits.py`: a resend of the prompt, or of the
        prompt one token back, then computes nothing)."""
        if (snap is None or r.num_generated or end < r.prompt_len - 1
                or not self.keeps_logits):
            return None
        return self.cache.alloc_logits()

    def _plan_snapshot(self, r: Request, end: int) -> tuple[int, str, int] | None:
        """A fresh state slot and the copy into it, when this chunk ends at a snapshot point."""
        cls = next((c for p, c in r.snap_points if p == end), None)
        if cls is None or r.state_slot is None:
            return None
        # the prompt-end point is kept-logits' own (a resend feeds nothing): it never drops a
        # snapshot (bug: at 3 device slots and no host tier a sub-agent's prompt end pushed out
        # its waiting parent's latest snapshot)
        kept_end = self.keeps_logits and end == r.prompt_len and not r.num_generated
        slot = self.cache.alloc_state(may_drop=not kept_end)
        if slot is None:
            why = "prompt_end_no_free" if kept_end else "state_pool_full"
            log.info(kv("snapshot_skip", rid=r.rid, pos=end, cls=cls, why=why))
            return None
        self.cache.copy_state(r.state_slot, slot)
        return (end, cls, slot)

    def discard(self, items: list[BatchItem]) -> None:
        """A planned step failed before `after_forward`: give back the state slots of the
        snapshots it planned and its kept-logits slots (its requests are aborted next)."""
        for it in items:
            if it.snapshot is not None:
                assert self.cache.state_pool is not None
                self.cache.state_pool.free([it.snapshot[2]])
            if it.keep_logits is not None:
                self.cache.free_logits(it.keep_logits)
            it.snapshot = it.keep_logits = None

    def _alloc(self, n: int, keep: set[int]) -> torch.Tensor | None:
        while True:
            slots = self.cache.alloc_kv(n)
            if slots is not None or not self._preempt_newest(keep):
                return slots

    def after_forward(self, item: BatchItem) -> None:
        """Advance `computed`; attach the snapshot the plan copied (bookkeeping only)."""
        r = item.req
        r.computed += item.n
        if self.alone.get(id(r), r.computed + 1) <= r.computed:
            del self.alone[id(r)]  # past the failed step: it is batched again
        if not self.has_state and item.n > 1:
            # attention-only models can share KV at any prefix: publish each prefill chunk
            c = self.cache.commit(r.ids[:r.computed], r.row[:r.computed], r.node, r.tree_len)
            r.row, r.node, r.tree_len = c.slots, c.node, r.computed
        while r.snap_points and r.snap_points[0][0] <= r.computed:
            r.snap_points.pop(0)
        if item.snapshot is not None:
            p, cls, slot = item.snapshot
            assert p == r.computed
            c = self.cache.commit(r.ids[:p], r.row[:p], r.node, r.tree_len)
            r.row, r.node, r.tree_len = torch.cat([c.slots, r.row[p:]]), c.node, p
            if not self.cache.attach_snapshot(c.node, slot, cls, self.user(r)):
                assert self.cache.state_pool is not None
                self.cache.state_pool.free([slot])
            kept = item.keep_logits
            if kept is not None and not self.cache.attach_logits(c.node, kept):
                self.cache.free_logits(kept)
        elif item.keep_logits is not None:
            self.cache.free_logits(item.keep_logits)

    def stats(self) -> dict:
        s = dict(self.cache.stats())
        s.update(reuse=dict(self.reuse), running=len(self.running), waiting=len(self.waiting),
                 kv_used=self.kv_alloc.num_used, kv_total=self.kv_alloc.num_slots)
        return s
