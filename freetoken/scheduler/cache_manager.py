"""What each request holds in the caches, for the scheduler: its locked prefix, KV row,
working state slot, the snapshots and kept-logits rows its chunks take.

`Scheduler` decides who runs and how many tokens; `CacheManager` does what that means for the
hybrid-state radix cache, and nothing else: `admit` (match, lock, a working state seeded from
the snapshot), `plan_snapshot` / `plan_logits` (the slots a chunk ending at a snapshot point
takes), `advance` (after the forward: commit, attach), `release` (finish or preempt: commit
the computed prefix, donate the working state), `drop` (abort: free what the request owns).
Every state movement it decides waits in the cache's ops for the engine (`take_ops`).

Kept logits (models with linear attention, `cache/logits.py`): the prompt chunks ending at
`prompt_len - 1` and `prompt_len` keep their last row's logits beside the snapshot there (the
admission adds the `prompt_len` snapshot point); a prompt whose whole length matches such a
node is admitted with nothing to feed, and its first step is a row of 0 tokens that samples
from the kept logits.
"""
from __future__ import annotations

import torch

from freetoken.cache import HybridRadixCache, SlotAllocator, StatePool, create_policy
from freetoken.cache.policy import END
from freetoken.log import get_logger, kv
from freetoken.scheduler.plan import BatchItem
from freetoken.scheduler.request import Request

log = get_logger("sched")


class CacheManager:
    """The cache side of scheduling (see the module docstring). `has_state`: the model has
    linear-attention layers (a state pool of `state_slots`, a host tier of `host_slots`)."""

    def __init__(self, kv_slots: int, state_slots: int, has_state: bool, chunk_tokens: int,
                 policy: str = "semantic", host_slots: int = 0, eviction: str = "value",
                 logits_slots: int = 0):
        self.kv_alloc = SlotAllocator(kv_slots)
        self.has_state = has_state
        # interval snapshots no finer than a prefill chunk: each chunk ends at a snapshot
        # point, and with layer streaming every chunk costs a pass of the experts over the link
        self.policy = create_policy(policy, **({"fill_every": max(4096, chunk_tokens)}
                                               if policy == "semantic" else {}))
        self.cache = HybridRadixCache(self.kv_alloc, StatePool(state_slots) if has_state else None,
                                      self.policy,
                                      StatePool(host_slots) if has_state and host_slots else None,
                                      eviction, logits_slots=logits_slots)
        self.reuse: dict[str, int] = {}  # why prompts resumed short of their KV match, counted

    @property
    def keeps_logits(self) -> bool:
        """Whether prompts keep their last logits rows (`cache/logits.py`)."""
        return self.cache.logits.pool.num_slots > 0

    @staticmethod
    def user(r: Request) -> str:
        """Who shares a snapshot: the session key, else the request itself."""
        return r.req.session_key or r.rid

    def admit(self, r: Request) -> bool:
        """Match `r`'s ids, lock the match and seed a working state slot from its snapshot;
        plan `r`'s snapshot points past the match. False (nothing held): no state slot."""
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
        if r.num_generated == 0 and points:  # heads and cuts named again; stale cuts (#23)
            self.cache.renew(r.ids, [(p, c) for p, c in points if p <= m.length], m.length,
                             self.user(r))
        r.snap_points = [(p, c) for p, c in points if p > m.length]
        r.logits_from = m.logits_slot if m.logits_slot >= 0 else None
        log.info(kv("admit", rid=r.rid, prompt=r.prompt_len, reused=m.length, kv_match=m.kv_len,
                    state_from=m.state_len, state_cls=m.state_class, tier=m.state_tier,
                    reason=m.reason, lost=m.lost or None, snapshots=len(r.snap_points)))
        return True

    def drop(self, r: Request) -> None:
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

    def end_lineage(self, r: Request) -> None:
        if r.in_lineage:
            r.in_lineage = False
            self.cache.end(self.user(r))

    def plan_logits(self, r: Request, end: int, snap: tuple | None) -> int | None:
        """A kept-logits slot for a prompt chunk ending at `prompt_len - 1` or `prompt_len`
        with a snapshot planned there (`cache/logits.py`: a resend of the prompt, or of the
        prompt one token back, then computes nothing)."""
        if (snap is None or r.num_generated or end < r.prompt_len - 1
                or not self.keeps_logits):
            return None
        return self.cache.alloc_logits()

    def plan_snapshot(self, r: Request, end: int) -> tuple[int, str, int] | None:
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
        """A planned step failed before `advance`: give back the state slots of the snapshots
        it planned and its kept-logits slots (its requests are aborted next)."""
        for it in items:
            if it.snapshot is not None:
                assert self.cache.state_pool is not None
                self.cache.state_pool.free([it.snapshot[2]])
            if it.keep_logits is not None:
                self.cache.free_logits(it.keep_logits)
            it.snapshot = it.keep_logits = None

    def advance(self, item: BatchItem) -> None:
        """`item` was computed (`r.computed` already counts it): publish what it made shareable
        (an attention-only model's prefill chunk, a chunk ending at its snapshot point with the
        snapshot and kept logits the plan copied). Bookkeeping only."""
        r = item.req
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
        s.update(reuse=dict(self.reuse), kv_used=self.kv_alloc.num_used,
                 kv_total=self.kv_alloc.num_slots)
        return s
