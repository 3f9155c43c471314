"""Checkpoint (recurrent-state snapshot) placement policies, picked by name.

Position semantics: a position `p` means "the state covering tokens `[0, p)`", i.e. the state
after feeding `ids[:p]` and before feeding `ids[p]`. To take it, the scheduler ends a prefill
chunk exactly at `p`, copies the working state into a fresh state slot and attaches it at the
radix node ending at `p` (the KV of `ids[:p]` must be committed to the tree first). An
`Anchor(position=p)` marks the first token of a block, so its snapshot is at the same `p`.

`positions(prompt_len, anchors)` returns the prefill snapshot positions, sorted, unique, each in
`[1, prompt_len - 1]`, each with a class. It always includes `prompt_len - 1` ("end" class unless
a higher class lands there): without kept logits an exact repeat of this prompt recomputes its
last token to get logits, and this snapshot lets it recompute only that token; with them
(`logits.py`, the scheduler adds `prompt_len` itself) it serves a resend one token back.
Positions at or below the prefix the request reused are already covered; the scheduler skips
them.

`on_finish(total_len)` returns the positions to snapshot when the request ends, where
`total_len` is the number of tokens whose KV and state the request computed (prompt + output
tokens fed back). `(total_len, "end")` is the request's own working state, donated without a
copy; a next turn that extends the sequence resumes from it.

Classes, from longest- to shortest-lived under state-pool pressure: `cut_point` (an anchor a
harness adapter predicts to be the next edit point) > `head` (end of system + tools, shared by
sub-agents and kept by compaction) > `anchor` = `interval` > `end`. The class is one term of a
snapshot's value (`snapshots.py`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

from freetoken.types.api import Anchor

CUT_POINT, HEAD, ANCHOR, INTERVAL, END = "cut_point", "head", "anchor", "interval", "end"
CLASS_RANK: dict[str, int] = {END: 0, INTERVAL: 1, ANCHOR: 1, HEAD: 2, CUT_POINT: 3}
IN_BY_ONE = ("turn_start", "tool_result_start")  # cut kinds taken past their opening tag
HEAD_KINDS = ("head_end", "system_block")  # anchor kinds whose snapshots get class `head`


def class_rank(cls: str) -> int:
    if cls not in CLASS_RANK:
        raise ValueError(f"unknown snapshot class {cls!r}; known: {sorted(CLASS_RANK)}")
    return CLASS_RANK[cls]


def _merge(points: list[tuple[int, str]], prompt_len: int) -> list[tuple[int, str]]:
    """Keep positions in [1, prompt_len - 1], one per position (highest class), sorted."""
    best: dict[int, str] = {}
    for p, cls in points:
        if 1 <= p <= prompt_len - 1 and (p not in best or class_rank(cls) > class_rank(best[p])):
            best[p] = cls
    return sorted(best.items())


class CheckpointPolicy(ABC):
    """Where to snapshot recurrent state. Stateless: one instance serves every request."""

    name: str = ""

    @abstractmethod
    def positions(self, prompt_len: int, anchors: Sequence[Anchor]) -> list[tuple[int, str]]:
        """Prefill snapshot positions `(p, class)`; see the module docstring."""

    def on_finish(self, total_len: int) -> list[tuple[int, str]]:
        """Snapshots to keep when the request ends: its final state, covering `[0, total_len)`."""
        return [(total_len, END)] if total_len >= 1 else []


_REGISTRY: dict[str, Callable[..., CheckpointPolicy]] = {}


def register_policy(name: str) -> Callable[[type[CheckpointPolicy]], type[CheckpointPolicy]]:
    def deco(cls: type[CheckpointPolicy]) -> type[CheckpointPolicy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def create_policy(name: str, **kw: Any) -> CheckpointPolicy:
    """`create_policy("semantic", max_per_request=8)`; unknown names raise `ValueError`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown checkpoint policy {name!r}; known: {available_policies()}")
    return _REGISTRY[name](**kw)


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


@register_policy("end_only")
class EndOnlyPolicy(CheckpointPolicy):
    """Baseline: the end of prefill (`prompt_len - 1`) and the end of the request."""

    def positions(self, prompt_len: int, anchors: Sequence[Anchor]) -> list[tuple[int, str]]:
        return _merge([(prompt_len - 1, END)], prompt_len)


@register_policy("interval")
class IntervalPolicy(CheckpointPolicy):
    """Baseline: every `every` tokens (`every, 2*every, ...`) plus the end points."""

    def __init__(self, every: int = 2048) -> None:
        if every < 1:
            raise ValueError(f"interval policy needs every >= 1, got {every}")
        self.every = every

    def positions(self, prompt_len: int, anchors: Sequence[Anchor]) -> list[tuple[int, str]]:
        pts = [(p, INTERVAL) for p in range(self.every, prompt_len, self.every)]
        return _merge(pts + [(prompt_len - 1, END)], prompt_len)


@register_policy("semantic")
class SemanticPolicy(CheckpointPolicy):
    """Default: snapshot at chat-template anchors where harnesses edit their context.

    Anchors with `cut_point=True` (any kind) get class `cut_point` (a `turn_start` or
    `tool_result_start` cut one token in, past the tag every such block shares); other
    `head_end` and `system_block` anchors get class `head`, other `turn_start` anchors class
    `anchor`; other kinds are ignored. (`system_block`: a point inside the system prompt that
    the proxy marks where another session of the same harness may part from this one: a system
    block boundary, a section holding the working directory or the date. Class `head` keeps it
    past the session's own plain snapshots, so a new session started later still finds it.)
    At most `max_per_request` anchor snapshots per request (the end point is extra), chosen in
    this order: cut points deepest first, then heads deepest first (`head_end`, shared by
    sub-agents and after compaction, then the system blocks), then turn starts deepest first
    (the deepest snapshot saves the most recompute next turn).

    Fill: where two chosen points (or the start) lie more than `fill_every` tokens apart, the
    multiples of `fill_every` inside the gap (at least `fill_every // 8` from either end) are
    candidates of class `interval`; the `max_fill` deepest are taken. A system prompt that
    two harness configurations share only in part (measured: OpenClaw over its two APIs, 8.8k
    of 11.7k tokens; OpenCode's sub-agents, 5k) has no anchor at its divergence; without a fill
    point the other session reuses nothing.
    """

    def __init__(self, max_per_request: int = 8, fill_every: int = 4096,
                 max_fill: int = 4) -> None:
        if max_per_request < 0 or max_fill < 0 or fill_every < 1:
            raise ValueError(f"semantic policy: bad max_per_request={max_per_request}, "
                             f"fill_every={fill_every}, max_fill={max_fill}")
        self.max_per_request = max_per_request
        self.fill_every, self.max_fill = fill_every, max_fill

    def _fill(self, points: list[int], prompt_len: int) -> list[tuple[int, str]]:
        f, margin = self.fill_every, self.fill_every // 8
        edges = sorted({0, prompt_len - 1, *points})
        cands = [m for a, b in pairwise(edges) if b - a > f
                 for m in range((a // f + 1) * f, b, f) if m - a >= margin and b - m >= margin]
        return [(p, INTERVAL) for p in sorted(cands)[::-1][: self.max_fill]]

    def positions(self, prompt_len: int, anchors: Sequence[Anchor]) -> list[tuple[int, str]]:
        ok = [a for a in anchors if 1 <= a.position <= prompt_len - 1]
        # a turn opens with `<|im_start|>` whatever its role: a cut there is taken one token
        # in, which the next request shares whichever turn it puts in that place (OpenClaw's
        # trailing context message makes way for the assistant's reply); so is a cut at a tool
        # result's opening tag, which a pruned result keeps (OpenCode's prune, #23)
        # ... and covers any other anchor at its tag (`head_end` sits on the first user turn's
        # `<|im_start|>`): no second snapshot one token before it
        inside = {a.position for a in ok if a.cut_point and a.kind in IN_BY_ONE}
        cuts = sorted({min(a.position + (a.kind in IN_BY_ONE), prompt_len - 1)
                       for a in ok if a.cut_point
                       and (a.kind in IN_BY_ONE or a.position not in inside)}, reverse=True)
        heads = sorted({a.position for a in ok if not a.cut_point and a.kind in HEAD_KINDS
                        and a.position not in inside}, reverse=True)
        turns = sorted({a.position for a in ok if not a.cut_point and a.kind == "turn_start"},
                       reverse=True)
        chosen: dict[int, str] = {}
        pts = [(p, CUT_POINT) for p in cuts] + [(p, HEAD) for p in heads]
        for p, cls in pts + [(p, ANCHOR) for p in turns]:
            if len(chosen) >= self.max_per_request:
                break
            chosen.setdefault(p, cls)
        fill = self._fill(list(chosen), prompt_len)
        return _merge(fill + list(chosen.items()) + [(prompt_len - 1, END)], prompt_len)
