"""Prefix caches: KV slot allocator, radix tree, recurrent-state pool, the hybrid-state radix
cache (`hybrid.py`; its reuse rule in `reuse.py`, its snapshot table in `tiers.py`) and
snapshot placement policies. Bookkeeping over integer slot ids, except `tensors.py`: the device
pools the ids index, which the engine allocates and the scheduler never imports; the engine
carries out the state ops the cache decides (`HybridRadixCache.take_ops`).

Snapshot eviction (what survives when the device state pool is full):

- Every snapshot has a value level: its class rank (end 0, interval/anchor 1, head 2,
  cut_point 3), +1 once a request has resumed from it, +2 once two or more sessions have
  created or resumed from it. The resume bonus of a plain snapshot (class <= anchor) used by
  one session only is cleared when that session attaches a deeper snapshot below it: an
  appending session resumed from it only because it was its latest. Such a plain one-session
  snapshot with another snapshot below it in the tree loses 2 levels (an appending session
  needs only its deepest).
- Session lineage (`lineage.py`; requests carry a session key and, for sub-agents, the parent
  key their harness sent, else the parent is inferred from prefix structure): a session's
  latest snapshot (last attached or resumed from) gains 2 levels (it resumes there next), 3
  while the session waits on running sub-agents (it will be back: its last use counts as
  now); a
  snapshot used only by finished sub-agents (declared ones, whose parent spoke again after they
  went idle) has level -2, below every other, except a head or predicted cut point (class
  head / cut_point: the next or a re-sent sub-agent resumes there), which has level 1. Its
  `keep_until` is its
  last use (snapshot clock: one tick per snapshot taken and per resume) plus
  `level * horizon` ticks (default horizon: twice the device + host slot count).
- The device victim is the unpinned snapshot with the smallest `keep_until`. It moves to the
  host tier (pinned RAM, `--state-host-mem`) with one copy; if the host tier is full, the host
  snapshot with the smallest `keep_until` is dropped to make room, unless the incoming one has
  the smaller `keep_until`, which is then dropped itself.
- A host snapshot serves a match like a device one: restoring it is one host-to-device copy
  into the request's working slot; it stays on the host.
- So a `head_end` snapshot shared by several sessions (level >= 5 once resumed) outlives one
  session's working snapshots (end/anchor, level <= 2; a hit cut point 4) by at least one
  horizon, yet an unused one still ages out.
- A node evicted from the KV tree drops its snapshot in either tier; a request's lock pins the
  snapshot at its node in either tier.
"""
from freetoken.cache.allocator import SlotAllocator
from freetoken.cache.hybrid import HybridMatch, HybridRadixCache, Released, Snapshot
from freetoken.cache.node import TreeNode
from freetoken.cache.policy import (
    ANCHOR,
    CLASS_RANK,
    CUT_POINT,
    END,
    HEAD,
    INTERVAL,
    CheckpointPolicy,
    EndOnlyPolicy,
    IntervalPolicy,
    SemanticPolicy,
    available_policies,
    class_rank,
    create_policy,
    register_policy,
)
from freetoken.cache.radix import Committed, MatchResult, RadixCache
from freetoken.cache.snapshots import DEVICE, HOST, StateOp
from freetoken.cache.state_pool import StatePool

__all__ = [
    "ANCHOR", "CLASS_RANK", "CUT_POINT", "DEVICE", "END", "HEAD", "HOST", "INTERVAL",
    "CheckpointPolicy", "Committed", "EndOnlyPolicy", "HybridMatch", "HybridRadixCache",
    "IntervalPolicy", "MatchResult", "RadixCache", "Released", "SemanticPolicy", "SlotAllocator",
    "Snapshot", "StateOp", "StatePool", "TreeNode", "available_policies", "class_rank",
    "create_policy", "register_policy",
]
