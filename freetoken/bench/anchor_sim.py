"""Token-level replay of agent sessions through the hybrid radix cache, no model.

Each request is `(session, ids, anchors)` as the server renders it, with the parent key its
harness sent (the cache's lineage: `begin` when it starts, `end` when it is done). The replay
plays the scheduler's cache calls for one request at a time (match, lock, working state,
policy snapshots during prefill, the final state donated at the end), the request's generated
tokens being `gen` (`traces.attribute_replies`: what the next request of its session sent
back). It counts, per request, the tokens recomputed (`len - reused`) and the unavoidable
minimum (`len - ` the longest prefix ever computed before, at least 1: the last token must be
fed for logits, unless they were kept). A prefix shorter than `MIN_REUSE` tokens counts as
nothing reusable: no policy keeps a snapshot that close to the start (the proxy places no head
break there, `proxy.heads.HeadBreaks.min_start`; a few tokens of prefill cost less than a
state copy), so the tokens two unrelated prompts share there (OpenCode's title request and its
main session: `<|im_start|>system\nYou are`, 5 tokens; Claude Code's main thread and its
sub-agents: 17) are in every policy's recompute and in the minimum, and an excess ratio compares
what placement decides (#23).

FreeToken's own policies (value eviction) also play what the scheduler adds for kept logits
(`cache/logits.py`): a snapshot at the prompt's end, and a kept row there and at `len - 1`
(the engine's pool: as many rows as device slots), so an exact resend reuses all of it.

Baselines imitate other engines' placement with LRU eviction at the same slot budgets:
`upstream` (FreeToken 0.1.2: the deepest 64-aligned point of each 8192-token prefill chunk plus
the request end), `llamacpp` (each user message and every 8192 tokens, at most 32 checkpoints
per sequence, the oldest dropped first).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from freetoken.cache import (
    END,
    INTERVAL,
    CheckpointPolicy,
    HybridRadixCache,
    RadixCache,
    SlotAllocator,
    StatePool,
    create_policy,
)
from freetoken.types.api import Anchor

CHUNK = 8192
MIN_REUSE = 64  # a shorter shared prefix is not reusable (module docstring)


@dataclass
class SimRequest:
    session: str
    ids: list[int]
    anchors: list[Anchor]
    gen: list[int] = field(default_factory=list)  # tokens generated and fed back
    cuts: list[int] | None = None  # predicted cut points (positions), None: no predictor
    parent: str | None = None  # the parent key its harness sent (a sub-agent's), if any
    trace: str = ""  # the recorded trace (or workload session) it comes from; "": session


class UpstreamPolicy(CheckpointPolicy):
    """FreeToken 0.1.2: per 8192-token prefill chunk its deepest 64-aligned point, plus the end."""

    name = "upstream"

    def positions(self, prompt_len: int, anchors: Sequence[Anchor]) -> list[tuple[int, str]]:
        pts = {(min(c + CHUNK, prompt_len - 1) // 64) * 64 for c in range(0, prompt_len, CHUNK)}
        out = {p: INTERVAL for p in pts if 1 <= p < prompt_len - 1}
        if prompt_len >= 2:
            out[prompt_len - 1] = END
        return sorted(out.items())


def user_message_starts(anchors: Sequence[Anchor]) -> list[int]:
    """`turn_start(user)` anchors that open a real user message (Qwen renders tool results as a
    user turn; those start with `<tool_response>` a few tokens in)."""
    results = [a.position for a in anchors if a.kind == "tool_result_start"]
    return [a.position for a in anchors if a.kind == "turn_start" and a.role == "user"
            and not any(0 < r - a.position <= 4 for r in results)]


class LlamaCppPolicy(CheckpointPolicy):
    """llama.cpp server: a checkpoint at each user message and every 8192 tokens, plus the end."""

    name = "llamacpp"
    per_sequence = 32

    def positions(self, prompt_len: int, anchors: Sequence[Anchor]) -> list[tuple[int, str]]:
        pts = set(user_message_starts(anchors)) | set(range(CHUNK, prompt_len, CHUNK))
        out = {p: INTERVAL for p in pts if 1 <= p < prompt_len - 1}
        if prompt_len >= 2:
            out[prompt_len - 1] = END
        return sorted(out.items())


def make_policy(spec: str) -> tuple[CheckpointPolicy, str]:
    """`semantic`, `semantic+cuts`, `interval:N`, `end_only`, `upstream`, `llamacpp` ->
    (policy, eviction)."""
    if spec == "upstream":
        return UpstreamPolicy(), "lru"
    if spec == "llamacpp":
        return LlamaCppPolicy(), "lru"
    if spec.startswith("interval:"):
        return create_policy("interval", every=int(spec.split(":", 1)[1])), "value"
    if spec in ("semantic", "semantic+cuts"):
        return create_policy("semantic"), "value"
    return create_policy(spec), "value"


@dataclass
class SimResult:
    recomputed: list[int] = field(default_factory=list)
    unavoidable: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)  # the session's first request
    snapshots_taken: int = 0
    stats: dict = field(default_factory=dict)

    def summary(self, slot_bytes: int) -> dict:
        # a session's first request has little to reuse (only a shared head); "per turn"
        # counts the later ones, where placement decides
        later = [i for i, f in enumerate(self.first) if not f]
        rec = sum(self.recomputed[i] for i in later)
        need = sum(self.unavoidable[i] for i in later)
        n = max(len(later), 1)
        return {"requests": len(self.recomputed), "turns": len(later),
                "prompt_tokens": sum(self.prompt),
                "recomputed_all": sum(self.recomputed), "unavoidable_all": sum(self.unavoidable),
                "recomputed": rec, "unavoidable": need,
                "recomputed_per_turn": round(rec / n, 1),
                "unavoidable_per_turn": round(need / n, 1),
                "avoidable_per_turn": round((rec - need) / n, 1),
                "ratio": round(rec / max(need, 1), 4),
                "snapshots_taken": self.snapshots_taken,
                "snapshot_bytes": self.snapshots_taken * slot_bytes,
                "evicted": self.stats.get("snapshots_evicted", 0),
                "spilled": self.stats.get("snapshots_spilled", 0),
                "restored": self.stats.get("snapshots_restored", 0),
                "dropped_kv": self.stats.get("snapshots_dropped", 0)}


def with_cuts(r: SimRequest) -> list[Anchor]:
    """`r.anchors` with `cut_point` set at the predicted positions."""
    cuts = set(r.cuts or ())
    return [Anchor(a.position, a.kind, a.role, a.cut_point or a.position in cuts)
            for a in r.anchors]


def replay(reqs: list[SimRequest], spec: str, device_slots: int, host_slots: int) -> SimResult:
    """Run `reqs` in order through a fresh cache under policy `spec` (see `make_policy`);
    `semantic+cuts` marks each request's predicted cut points (`SimRequest.cuts`)."""
    policy, eviction = make_policy(spec)
    total = sum(len(r.ids) + len(r.gen) for r in reqs) + 1
    keep = eviction == "value"  # ours: the engine keeps prompt-end logits (module docstring)
    cache = HybridRadixCache(SlotAllocator(total), StatePool(device_slots), policy,
                             StatePool(host_slots) if host_slots else None, eviction,
                             logits_slots=device_slots if keep else 0)
    seen = RadixCache(SlotAllocator(0))  # every token sequence ever computed
    per_seq: dict[str, list] = {}
    started: set[str] = set()
    out = SimResult()
    for r in reqs:
        ids = r.ids
        anchors = with_cuts(r) if spec == "semantic+cuts" else r.anchors
        m = cache.match(ids, r.session)
        cache.lock(m.node)
        cache.begin(r.session, r.parent, m)
        path, n, _, k = seen.walk(ids[: len(ids) - 1])
        out.recomputed.append(len(ids) - m.length)
        out.unavoidable.append(len(ids) - (n + k if n + k >= MIN_REUSE else 0))
        out.prompt.append(len(ids))
        unit = r.trace or r.session
        out.first.append(unit not in started)
        started.add(unit)
        row = torch.cat([m.kv_slots, cache.alloc_kv(len(ids) + len(r.gen) - m.length)])
        work = cache.alloc_state()
        assert work is not None
        cache.load_state(m, work)
        node, tree_len = m.node, m.length
        points = policy.positions(len(ids), anchors) + ([(len(ids), END)] if keep else [])
        cache.renew(ids, [(p, c) for p, c in points if p <= m.length], m.length, r.session)
        for p, cls in points:
            if p <= m.length:
                continue
            # the prompt-end point never drops a snapshot (as the scheduler)
            fresh = cache.alloc_state(may_drop=not (keep and p == len(ids)))
            if fresh is None:
                continue
            cache.copy_state(work, fresh)
            c = cache.commit(ids[:p], row[:p], node, tree_len)
            row, node, tree_len = torch.cat([c.slots, row[p:]]), c.node, p
            if cache.attach_snapshot(c.node, fresh, cls, r.session):
                out.snapshots_taken += 1
                per_seq.setdefault(r.session, []).append(c.node)
            else:
                cache.state_pool.free([fresh])  # type: ignore[union-attr]
            lg = cache.alloc_logits() if keep and p >= len(ids) - 1 else None
            if lg is not None and not cache.attach_logits(c.node, lg):
                cache.free_logits(lg)
        full = ids + r.gen
        rel = cache.release(full, row, node, tree_len, work, END, r.session)
        if rel.snapshot_taken:
            out.snapshots_taken += 1
            path = cache.radix.walk(full)[0]  # read-only: the node release attached at
            per_seq.setdefault(r.session, []).append(path[-1])
        else:
            cache.state_pool.free([work])  # type: ignore[union-attr]
        cache.end(r.session)
        cache.take_ops()
        seen.insert(full, torch.zeros(len(full), dtype=torch.long))
        if isinstance(policy, LlamaCppPolicy):
            _cap_sequence(cache, per_seq.get(r.session, []), policy.per_sequence)
    out.stats = cache.stats()
    return out


def _cap_sequence(cache: HybridRadixCache, nodes: list, cap: int) -> None:
    live = [x for x in nodes if x in cache._snaps]
    nodes[:] = live
    while len(nodes) > cap:
        cache.drop_snapshot(nodes.pop(0), "per_sequence_cap")
