"""Session lineage: which requests belong to one session, which sessions are a session's
sub-agents, which of those are still running, and each session's latest snapshot.

Pure bookkeeping over session keys (strings) and radix nodes; the cache reads it for one term
of a snapshot's value (`snapshots.level`):

- a session's latest snapshot (the one it last attached or resumed from) gains `LATEST`
  levels: an appending session resumes there next, whatever its class (measured on the shared
  traces interleaved at 16 + 32 slots: idle sessions lost their `end` to other sessions' cut
  points, 1.036x -> 1.0006x the minimum);
- a session is *waiting on children* while one of its sub-agents has not finished; its latest
  snapshot (the one it last attached or resumed from: the state it will resume from when the
  children are done) gains `BACK` levels instead;
- a sub-agent declared by its harness (a parent key) is *finished* when its parent starts a
  request while the sub-agent has none in flight, provided the parent was idle when the
  sub-agent started (the parent waited for it: Claude Code and OpenCode do). A snapshot used
  only by finished sub-agents drops to level `FINISHED`, below every other snapshot, unless it
  is a head or a predicted cut point (class `head` / `cut_point`): those keep their level
  without a lineage term. The next sub-agent the parent spawns resumes at the sub-agents'
  shared head (system + their tools), and Claude Code re-sends a sub-agent's task to a new
  agent id after a compaction (recorded: tests/data/harness_traces/claude_code/cc_compact.jsonl),
  which resumes at the finished one's `<think>` cut; at 16 + 32 slots the -2 rule lost both
  (11,437 tokens recomputed for a re-sent prompt whose minimum was 1). A later request of the
  sub-agent makes it running again.
- a session's *latest cut* (the deepest cut point its latest request attached) gains the same
  term as its latest snapshot: where the harness renders the reply differently from the
  generation prompt (Claude Code's sub-agents: an empty `<think>` block in the prompt, the
  reasoning in the history) the next request resumes there, not at the `end`; and while the
  session waits on children its heads and cut points do not age (`snapshots.keep_until`).

Where no header names a parent, the parent comes from prefix structure: a new session whose
first prompt resumes from a snapshot another (non-sub-agent) session made is that session's
sub-agent (the most recently started one, when several share the snapshot), unless that
snapshot is the other session's latest (then the new one continues it). Such an inferred
sub-agent gives its parent the `BACK` bonus but is never marked finished: an unrelated session
of the same harness shares the same head, and must not lose its snapshots when the other one
speaks again.

`parent` of `begin` is the parent's session key, or a prefix of it (the harness's session id,
when the adapter cannot know the parent's full key): it resolves to the most recently started
non-sub-agent session whose key starts with it.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from freetoken.log import get_logger, kv

log = get_logger("cache")

LATEST = 2  # levels any session's latest snapshot gains: where it resumes next
BACK = 3  # levels a waiting parent's latest snapshot gains (a hit cut point's worth)
FINISHED = -2  # the level of a snapshot used only by finished sub-agents
MAX_SESSIONS = 4096  # past this, the least recently started idle half is forgotten


@dataclass
class Session:
    key: str
    parent: str | None = None
    declared: bool = False  # the parent came from a header, not from prefix structure
    inflight: int = 0
    started: int = 0  # lineage clock at its latest request start
    parent_waited: bool = True  # its parent had nothing in flight while this one ran
    finished: bool = False
    latest: Hashable | None = None  # node of its latest snapshot
    latest_cut: Hashable | None = None  # node of the deepest cut its latest request attached
    children: set[str] = field(default_factory=set)


class Lineage:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.clock = 0

    def resolve(self, parent: str | None) -> str | None:
        """The session `parent` names: that key, else the most recently started top-level
        session whose key starts with it; None when nothing matches."""
        if parent is None:
            return None
        if parent in self.sessions:
            return parent
        cands = [s for s in self.sessions.values()
                 if s.parent is None and s.key.startswith(parent)]
        return max(cands, key=lambda s: s.started).key if cands else None

    def begin(self, key: str, parent: str | None = None,
              resumed_users: Iterable[str] = (), resumed: Hashable | None = None) -> Session:
        """A request of session `key` starts. `parent`: the header's parent key (see the module
        docstring); `resumed_users`: the sessions of the snapshot `resumed` its prompt resumed
        from (for the inferred parent of a new session without one; a session whose latest
        snapshot that is continues there, it did not spawn this one)."""
        self.clock += 1
        if key not in self.sessions and len(self.sessions) >= MAX_SESSIONS:
            self._prune()
        s = self.sessions.get(key)
        new = s is None
        if s is None:
            s = self.sessions[key] = Session(key)
        p = self.resolve(parent)
        declared = p is not None
        if p is None and new and parent is None:
            others = [self.sessions[u] for u in resumed_users
                      if u != key and u in self.sessions and self.sessions[u].parent is None
                      and self.sessions[u].latest is not resumed]
            p = max(others, key=lambda o: o.started).key if others else None
        if p is not None and p != key and s.parent is None and not s.children:
            s.parent, s.declared = p, declared
            self.sessions[p].children.add(key)
            log.debug(kv("lineage", session=key, parent=p, declared=declared))
        if s.parent is not None and (new or s.finished or s.inflight == 0):
            s.parent_waited = self.sessions[s.parent].inflight == 0
        s.finished = False
        s.latest_cut = None
        for c in s.children:  # the parent is back: the children it waited for are done
            child = self.sessions[c]
            if child.declared and child.inflight == 0 and child.parent_waited \
                    and not child.finished:
                child.finished = True
                log.debug(kv("lineage_finished", session=c, parent=key))
            elif child.inflight:
                child.parent_waited = False
        s.inflight += 1
        s.started = self.clock
        return s

    def _prune(self) -> None:
        """Forget the least recently started idle half (a server lives for many sessions)."""
        idle = sorted((s for s in self.sessions.values() if s.inflight == 0),
                      key=lambda s: s.started)
        for s in idle[: len(self.sessions) // 2]:
            del self.sessions[s.key]
        for s in self.sessions.values():
            s.children &= self.sessions.keys()
            if s.parent is not None and s.parent not in self.sessions:
                s.parent = None

    def end(self, key: str) -> None:
        s = self.sessions.get(key)
        if s is not None and s.inflight > 0:
            s.inflight -= 1

    def touch(self, key: str | None, node: Hashable) -> None:
        """`node`'s snapshot is `key`'s latest (attached or resumed from)."""
        if key is not None and key in self.sessions:
            self.sessions[key].latest = node

    def touch_cut(self, key: str | None, node: Hashable) -> None:
        """`key`'s request attached (or was offered) a cut point at `node`, deeper than any it
        attached before (a request's points come in position order)."""
        if key is not None and key in self.sessions:
            self.sessions[key].latest_cut = node

    def forget_node(self, node: Hashable) -> None:
        for s in self.sessions.values():
            if s.latest is node:
                s.latest = None
            if s.latest_cut is node:
                s.latest_cut = None

    def waiting(self, users: set[str]) -> bool:
        """Some session of `users` waits on its sub-agents."""
        return any(self.waiting_on_children(u) for u in users)

    def waiting_on_children(self, key: str) -> bool:
        s = self.sessions.get(key)
        return s is not None and any(not self.sessions[c].finished for c in s.children)

    def bonus(self, node: Hashable, users: set[str]) -> int | None:
        """The lineage term of the snapshot at `node` used by `users`: None (level `FINISHED`)
        when every user is a finished sub-agent; `BACK` when it is the latest of a user
        waiting on children; `LATEST` when it is the latest of a user; else 0 (a user's latest
        cut counts as its latest)."""
        if users and all(u in self.sessions and self.sessions[u].finished for u in users):
            return None
        best = 0
        for u in users:
            s = self.sessions.get(u)
            if s is not None and (s.latest is node or s.latest_cut is node):
                if self.waiting_on_children(u):
                    return BACK
                best = LATEST
        return best
