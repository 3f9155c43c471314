"""Generators: deterministic, sized as specified, and faithful to the recorded edit behaviour."""
from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
from fake_server import prompt_tokens, strip_cache_control

from workloads import NAMES, Workload, build_workload
from workloads.convert import anthropic_to_openai, openai_to_anthropic
from workloads.tokens import request_tokens
from workloads.w4 import TRAILING_MARK, system_floor_tokens


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_versioned_and_tiny_sized(name: str, tmp_path: Path) -> None:
    a, b = build_workload(name, "tiny"), build_workload(name, "tiny")
    assert a.version == b.version and a.digest() == b.digest()
    assert build_workload(name, "tiny", seed=1).digest() != a.digest()
    assert a.version.startswith(f"{name}/v") and "/tiny/" in a.version
    back = Workload.from_jsonl(a.to_jsonl(tmp_path / "w.jsonl"))
    assert back.digest() == a.digest() and back.version == a.version
    sizes = [request_tokens(t.body) for t in a.turns]
    assert 100 <= min(sizes) and max(sizes) <= 3000, sizes
    assert all(1 <= t.output_tokens <= 32 for t in a.turns)


def test_shapes_per_workload() -> None:
    w1 = build_workload("W1", "full")
    assert len(w1.turns) == 1 and w1.turns[0].output_tokens >= 2000
    assert "tools" not in w1.turns[0].body
    w2 = build_workload("W2", "tiny")
    assert [len(t.reply["tool_calls"]) for t in w2.turns] == [1, 1, 1]
    assert [t.reply["tool_calls"][0]["function"]["name"] for t in w2.turns] == \
        ["read", "bash", "edit"]
    tool_msgs = [m["content"] for m in w2.turns[2].body["messages"] if m["role"] == "tool"]
    assert "<content>" in tool_msgs[0] and "failed" in tool_msgs[1]
    w4 = build_workload("W4", "tiny")
    assert len(w4.turns) == 13


def test_append_only_sessions_w2_w3() -> None:
    """Each request of a session extends the previous one (cache_control aside), and the
    message it appends first is the recorded reply (tool-call arguments compacted)."""
    for name in ("W2", "W3"):
        w = build_workload(name, "tiny")
        for turns in w.sessions().values():
            for prev, cur in itertools.pairwise(turns):
                p, c = (
                    strip_cache_control(prev.body["messages"]),
                    strip_cache_control(cur.body["messages"]),
                )
                assert c[: len(p)] == p
                added = c[len(p)]
                assert added["role"] == "assistant"
                if name == "W3":
                    assert added["content"] == strip_cache_control(prev.reply["content"])
                else:
                    args = [json.loads(x["function"]["arguments"]) for x in added["tool_calls"]]
                    assert args == [json.loads(x["function"]["arguments"])
                                    for x in prev.reply["tool_calls"]]


def test_w3_fanout_and_full_sizes() -> None:
    tiny = build_workload("W3", "tiny")
    s1, s2 = tiny.turn("S1.1"), tiny.turn("S2.1")
    assert s1.after == s2.after == ("M3",) and (s1.delay_s, s2.delay_s) == (0.0, 0.04)
    assert tiny.turn("M4").after == ("S1.5", "S2.5")
    full = build_workload("W3", "full")
    a, b = prompt_tokens(full.turn("S1.1").body), prompt_tokens(full.turn("S2.1").body)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 0.9 < shared / len(a) < 1.0  # siblings share 90–99% of their prompt (as recorded)
    assert len(full.turn("M1").body["tools"]) == 24 and len(full.turn("S1.1").body["tools"]) == 21
    assert full.turn("M1").body["thinking"] == {"type": "adaptive"}
    finals = {s: request_tokens(t[-1].body) for s, t in full.sessions().items()}
    assert len(finals) == 3 and all(56_000 <= n <= 66_000 for n in finals.values()), finals
    # Exactly one moving cache_control breakpoint in the messages, on the last user block.
    for t in full.turns:
        marks = [(i, b) for i, m in enumerate(t.body["messages"]) if isinstance(m["content"], list)
                 for b in m["content"] if "cache_control" in b]
        last_user = max(i for i, m in enumerate(t.body["messages"]) if m["role"] == "user")
        assert [i for i, _ in marks] == [last_user]


def test_w4_rolling_trailing_context_and_floor() -> None:
    w = build_workload("W4", "tiny")
    for prev, cur in zip(w.turns, w.turns[1:]):
        p, c = prev.body["messages"], cur.body["messages"]
        assert p[-1]["content"][0]["text"].startswith(TRAILING_MARK)
        assert c[-1] == p[-1]  # a fresh copy re-appended at the end ...
        assert c[: len(p) - 1] == p[:-1]  # ... after removing it from where it was
        assert sum(json.dumps(m).count(TRAILING_MARK) for m in c) == 1
        assert all("_" not in tc["id"] for m in c for tc in m.get("tool_calls") or [])
    users = [m["content"] for m in w.turns[-1].body["messages"]
             if m["role"] == "user" and isinstance(m["content"], str)]
    assert len(users) == 2 and all(u.startswith("[Mon 2026-11-30 ") for u in users)
    floor = system_floor_tokens(build_workload("W4", "full"))
    assert abs(floor - 24_500) <= 2_450, floor


def test_api_conversion_round_trip() -> None:
    w2 = build_workload("W2", "tiny").turns[-1].body
    back = anthropic_to_openai(openai_to_anthropic(copy.deepcopy(w2)))
    assert back["messages"] == [{**m, "content": m["content"] or None}
                                if m["role"] == "assistant" else m for m in w2["messages"]]
    assert back["tools"] == w2["tools"]
