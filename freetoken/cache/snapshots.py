"""Recurrent-state snapshots in two tiers, their value, and the state operations they need.

A snapshot lives in the *device* tier (a slot of the device `StatePool`) or the *host* tier (a
slot of a host `StatePool`, pinned RAM on CUDA). The cache only does bookkeeping: every state
movement it decides is appended as a `StateOp` to the cache's pending list, and the engine
carries the list out in order (`freetoken.engine.cache_ops`). Order matters: a device slot freed
by a spill may be the destination of a later copy in the same list.

Value (the eviction rule; the cache package docstring states it for users):

    level(s)      = rank(class) + [s.hits >= 1] + 2 * [len(s.users) >= 2] - 2 * [covered plain]
                    + BACK (3) if s is the latest of a session waiting on its sub-agents,
                      else LATEST (2) if s is the latest of any session
    level(s)      = FINISHED (-2)   when every user of s is a finished sub-agent and its
                                    class is below head (a finished sub-agent's heads and
                                    cut points keep their level, without a lineage term)
    keep_until(s) = s.last_access + level(s) * horizon
                  = now + level(s) * horizon   for the latest, and the heads and cut points,
                                               of a session waiting on its sub-agents (now:
                                               the snapshot clock: they do not age)

(lineage terms: `lineage.py`. A parent waiting on sub-agents will resume from its latest
snapshot, so it is kept like a hit cut point that was just used, and its heads and cut points
do not age while it waits: at 16 + 32 slots with nine traces interleaved, their last use aged
while two rounds of sub-agents ran, Claude Code's main thread then recomputed its whole
19.6k-token prompt and, after its compaction, the 17.4k tokens of system + tools, #23. A
finished sub-agent's working snapshots go first, but not its heads and cut points: the next
sub-agent of the same kind resumes at their shared head, a re-sent one at its `<think>`.)

"covered plain": another snapshot (either tier) sits below it in the tree, its class is at most
`anchor` and at most one session uses it: a session that keeps appending only needs its
deepest snapshot, so the ones it left behind go first (measured on the shared traces at 16 + 32
slots: recompute 1.13x -> 1.06x the floor).

with rank: end 0, interval 1, anchor 1, head 2, cut_point 3 (`hits` of a plain single-session
snapshot is cleared when its session attaches a deeper one below it: `HybridRadixCache`). The
victim is the unpinned snapshot with the smallest `keep_until` (ties: the least recently used;
every tick goes to one snapshot, so last uses never tie). Each level buys `horizon` ticks of the
snapshot clock (one tick per attach and per resume), so value delays eviction but never makes a
snapshot immortal. With `eviction="lru"` the victim is the least recently used (the baselines).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from freetoken.cache.lineage import FINISHED
from freetoken.cache.policy import HEAD, class_rank

DEVICE, HOST = "device", "host"

COPY = "copy"  # device src -> device dst
RESET = "reset"  # zero device dst (src unused, -1)
SPILL = "spill"  # device src -> host dst
RESTORE = "restore"  # host src -> device dst


class StateOp(NamedTuple):
    """One state movement for the engine: `kind` in copy/reset/spill/restore (see above)."""

    kind: str
    src: int
    dst: int


@dataclass
class Snapshot:
    slot: int  # in the pool of `tier`
    cls: str
    last_access: int
    tier: str = DEVICE
    hits: int = 0  # requests that resumed from it
    users: set[str] = field(default_factory=set)  # sessions that created or resumed from it


def level(s: Snapshot, covered: bool = False, lineage: int | None = 0) -> int:
    """`covered`: another snapshot sits below this one in the tree. `lineage`: the lineage
    term (`Lineage.bonus`: `BACK` for a waiting parent's latest, None for a snapshot only
    finished sub-agents used, which then has level `FINISHED`, unless it is a head or a cut
    point: those keep their level without a lineage term)."""
    if lineage is None:
        if class_rank(s.cls) < class_rank(HEAD):
            return FINISHED
        lineage = 0
    plain = covered and len(s.users) <= 1 and class_rank(s.cls) <= 1
    return class_rank(s.cls) + (s.hits >= 1) + 2 * (len(s.users) >= 2) - 2 * plain + lineage


def keep_until(s: Snapshot, horizon: int, covered: bool = False,
               lineage: int | None = 0, now: int | None = None) -> int:
    """`now`: the snapshot clock when `s` counts as used now (a waiting parent's latest, heads
    and cut points: `SnapshotTiers._key`), else None."""
    t = now if now is not None else s.last_access
    return t + level(s, covered, lineage) * horizon


def victim_key(s: Snapshot, eviction: str, horizon: int, covered: bool = False,
               lineage: int | None = 0, now: int | None = None) -> tuple[int, int]:
    """Sort key: the smallest is evicted first."""
    if eviction == "lru":
        return (s.last_access, 0)
    return (keep_until(s, horizon, covered, lineage, now), s.last_access)


EVICTIONS = ("value", "lru")
