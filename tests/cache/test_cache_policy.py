"""Checkpoint policies: explicit expected positions, and the contract on random inputs."""
from __future__ import annotations

import random

import pytest

from freetoken.cache import CLASS_RANK, available_policies, create_policy
from freetoken.types.api import Anchor


def test_registry() -> None:
    assert {"end_only", "interval", "semantic"} <= set(available_policies())
    assert create_policy("interval", every=7).every == 7  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        create_policy("nope")


def test_end_only() -> None:
    p = create_policy("end_only")
    assert p.positions(100, [Anchor(10, "head_end")]) == [(99, "end")]
    assert p.positions(1, []) == []  # nothing before the only token
    assert p.on_finish(130) == [(130, "end")]


def test_interval() -> None:
    p = create_policy("interval", every=4)
    assert p.positions(10, []) == [(4, "interval"), (8, "interval"), (9, "end")]
    assert p.positions(9, []) == [(4, "interval"), (8, "interval")]  # the higher class wins


def test_semantic_classes_and_cap() -> None:
    anchors = [
        Anchor(5, "head_end"),
        Anchor(20, "turn_start", role="user"),
        Anchor(30, "turn_start", role="assistant", cut_point=True),
        Anchor(35, "think_start"),  # not a snapshot kind
        Anchor(40, "tool_result_start", cut_point=True),
        Anchor(50, "turn_start", role="user"),
        Anchor(99, "turn_start"),  # the last token: merges with the end point
        Anchor(120, "turn_start"),  # past the prompt
    ]
    p = create_policy("semantic", max_per_request=10)
    # turn_start and tool_result_start cuts are taken one token in (past the `<|im_start|>` /
    # `<tool_response>` that any next turn / pruned result shares: #23, OpenCode's prune)
    assert p.positions(100, anchors) == [(5, "head"), (20, "anchor"), (31, "cut_point"),
                                         (41, "cut_point"), (50, "anchor"), (99, "anchor")]
    # cap 3: both cut points, then head_end, then (none left)
    assert create_policy("semantic", max_per_request=3).positions(100, anchors) == [
        (5, "head"), (31, "cut_point"), (41, "cut_point"), (99, "end")]
    # cap 4: the deepest turn start comes next
    assert (99, "anchor") in create_policy("semantic", max_per_request=4).positions(100, anchors)


@pytest.mark.parametrize("name,kw", [("end_only", {}), ("interval", {"every": 3}),
                                     ("semantic", {"max_per_request": 2})])
def test_contract_on_random_inputs(name: str, kw: dict) -> None:
    rng = random.Random(1)
    pol = create_policy(name, **kw)
    kinds = ["head_end", "turn_start", "think_start", "tool_result_start"]
    for _ in range(300):
        n = rng.randint(0, 40)
        anchors = [Anchor(rng.randint(-2, 45), rng.choice(kinds), cut_point=rng.random() < 0.3)
                   for _ in range(rng.randint(0, 8))]
        pts = pol.positions(n, anchors)
        pos = [q for q, _ in pts]
        assert pos == sorted(set(pos)) and all(1 <= q <= n - 1 for q in pos)
        assert all(c in CLASS_RANK for _, c in pts)
        if n >= 2:
            assert pos[-1] == n - 1  # the exact-repeat point is always there
        if name == "semantic":
            assert sum(1 for q, c in pts if q != n - 1 or c != "end") <= 2
            ins = ("turn_start", "tool_result_start")  # taken one token in, covering the tag
            inside = {a.position for a in anchors if a.cut_point and a.kind in ins}
            want = {min(a.position + (a.kind in ins), n - 1) for a in anchors
                    if a.cut_point and 1 <= a.position < n
                    and (a.kind in ins or a.position not in inside)}
            got = {q for q, c in pts if c == "cut_point"}
            assert got <= want and len(got) == min(len(want), 2)


def test_semantic_system_blocks_are_heads() -> None:
    """The proxy's `system_block` anchors (where a new session of the harness may part from this
    one inside the system prompt) get class `head`, which the value rule keeps past a
    session's plain snapshots; before, the policy ignored the kind and the second session
    recomputed the shared system prompt."""
    anchors = [Anchor(300, "system_block"), Anchor(900, "system_block"),
               Anchor(1000, "head_end", cut_point=True), Anchor(1200, "turn_start", "user")]
    assert create_policy("semantic").positions(1300, anchors) == [
        (300, "head"), (900, "head"), (1000, "cut_point"), (1200, "anchor"), (1299, "end")]
    # under the cap, head_end (a cut point here) first, then the deepest system block
    assert create_policy("semantic", max_per_request=2).positions(1300, anchors) == [
        (900, "head"), (1000, "cut_point"), (1299, "end")]
