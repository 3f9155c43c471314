"""Claude Code's compaction, resume and re-sent sub-agents (#23 item 3), on the recording
`tests/data/harness_traces/claude_code/cc_compact.jsonl` (real Claude Code 2.1.197 against the
recording stub: `claude -p`, `--continue "/compact"`, a further turn, `--resume`). The oracle is
the token stream itself: the longest prefix a request shares with an earlier one (what no
cache can beat), and what the bench's replay of the engine recomputes against it.

Records by seq: 1-10 the first run (4-7 two sub-agents), 11 the compaction request, 12 the
first request after it, 13-16 two sub-agents re-sent with the same tasks to new agent ids,
20 the `--resume` turn.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken.bench.anchor_sim import replay
from freetoken.bench.cli_anchors import adapter_cuts, head_breaks
from freetoken.bench.traces import _render, attribute_replies, load_trace
from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
from freetoken.types.api import Anchor
from harness_adapters import HarnessRequest, detect_adapter

TRACE = Path(__file__).parents[1] / "data" / "harness_traces" / "claude_code" / "cc_compact.jsonl"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def recs() -> list[dict]:
    return [json.loads(x) for x in TRACE.read_text().splitlines()]


@pytest.fixture(scope="module")
def reqs(tok: ChatTokenizer) -> list:
    out = load_trace(tok, TRACE, "cc", adapter_cuts, head_breaks(tok))
    attribute_replies(out, tok.special_ids["<|im_end|>"])
    return out


def _lcp(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _req(rec: dict) -> HarnessRequest:
    return HarnessRequest("anthropic", rec["path"],
                          {k.lower(): v for k, v in rec["headers"].items()}, rec["body"])


def _bash(body: dict) -> str:
    return next(t["description"] for t in body["tools"] if t["name"] == "Bash")


def test_the_recording_is_what_the_test_names(recs) -> None:
    sid = {r["headers"]["X-Claude-Code-Session-Id"] for r in recs}
    assert len(recs) == 20 and len(sid) == 1
    last = recs[10]["body"]["messages"][-1]["content"][-1]["text"]
    assert "create a detailed summary of the conversation so far" in last
    assert "This session is being continued" in recs[11]["body"]["messages"][0]["content"][1][
        "text"]
    agents = [r["headers"].get("x-claude-code-agent-id") for r in recs]
    assert len({agents[3], agents[4], agents[12], agents[13]}) == 4  # four agent ids
    assert all("redacted" in r["headers"]["x-api-key"] for r in recs)


def test_a_resume_drops_the_1m_suffix_and_normalisation_unifies_it(recs) -> None:
    """Bug caught: the resumed process (seq 11 on) writes `Opus 4.8` / `claude-opus-4-8`
    where the session had `Opus 4.8 (1M context)` / `claude-opus-4-8[1m]`, also in the Bash
    tool's `Co-Authored-By: Claude Opus 4.8 (1M context)` line, which `unify_model_suffix`
    missed: the compaction request parted from the session at the Bash tool (token 2,326)."""
    before, after = recs[9]["body"], recs[10]["body"]
    assert "Claude Opus 4.8 (1M context) <" in _bash(before)
    assert "(1M context)" not in _bash(after) and "[1m]" not in json.dumps(after["system"])
    n10, fired = detect_adapter(_req(recs[9])).normalise(_req(recs[9]))
    n11, _ = detect_adapter(_req(recs[10])).normalise(_req(recs[10]))
    assert fired["unify_model_suffix"] == 3  # system: name and id; Bash: the co-author line
    assert n10["system"] == n11["system"] and n10["tools"] == n11["tools"]
    ad = detect_adapter(_req(recs[9]))
    keys = [ad.session_key(HarnessRequest("anthropic", "", _req(r).headers, n))
            for r, n in ((recs[9], n10), (recs[10], n11))]
    assert keys[0] == keys[1]  # the compaction request continues the session


def test_the_compaction_request_parts_at_the_predicted_generation_prompt(tok, reqs) -> None:
    """Claude Code's summary request is the latest prompt with the summary instructions in a
    new user turn where the reply would go: it parts from seq 10's prompt one token into its
    generation prompt, the `turn_start(assistant)` the adapter predicts (a cut the engine
    takes one token in); the replay resumes it exactly there."""
    prev, comp = reqs[9], reqs[10]
    gen = [a for a in prev.anchors if a.kind == "turn_start"][-1]
    assert gen.role == "assistant" and gen.position in prev.cuts
    assert _lcp(prev.ids, comp.ids) == gen.position + 1 == len(prev.ids) - 2
    r = replay(reqs[:11], "semantic+cuts", 64, 256)
    assert r.recomputed[10] == r.unavoidable[10] == len(comp.ids) - (gen.position + 1)
    plain = replay(reqs[:11], "semantic", 64, 256)  # the plain turn-start snapshot: 1 short
    assert plain.recomputed[10] == r.recomputed[10] + 1


def test_the_post_compaction_request_resumes_after_the_system_reminder(tok, reqs) -> None:
    """After compaction only system + tools and the first user message's `<system-reminder>`
    block survive. Without a user break there the request resumed at `head_end` and recomputed
    the block (78 tokens); the break's anchor (the block's tokens less its last) leaves 1."""
    post = reqs[11]
    lcp = max(_lcp(post.ids, p.ids + p.gen) for p in reqs[:11])
    block = [a for a in post.anchors if a.kind == "system_block"][-1]
    head = next(a.position for a in post.anchors if a.kind == "head_end")
    assert head < block.position <= lcp <= block.position + 1
    assert lcp - head > 60  # the reminder block is worth a snapshot
    r = replay(reqs[:12], "semantic+cuts", 64, 256)
    assert r.recomputed[11] - r.unavoidable[11] == lcp - block.position


@pytest.mark.parametrize("budget", [(64, 256), (16, 32)])
def test_resent_sub_agent_prompts_resume_at_the_finished_sub_agents_cut(reqs, budget) -> None:
    """Seq 13/14 send seq 4/5's prompts again, token for token, to new agent ids after the
    sub-agents finished. Bug caught at 16 + 32 slots: a finished sub-agent's snapshots all
    had the lowest level, so the re-sent prompt recomputed all 11,438 tokens (its minimum:
    1). Its predicted `<think>` cut (4 tokens before the end) now keeps its level."""
    assert reqs[12].ids == reqs[3].ids and reqs[13].ids == reqs[4].ids
    assert reqs[12].session != reqs[3].session and reqs[12].parent == reqs[3].parent
    r = replay(reqs, "semantic+cuts", *budget)
    for i in (12, 13):
        assert r.recomputed[i] <= 4, (i, r.recomputed[i])


def test_cut_points_per_request_kind(tok, recs) -> None:
    """The adapter's cuts on hand-made anchors: the main thread's generation prompt (thinking
    on: no `<think>` opened) is a cut; a sub-agent's (thinking off: an empty `<think>` block)
    gets the `<think>` cut only, no second one 2 tokens before it."""
    ad = detect_adapter(_req(recs[0]))
    main = [Anchor(5, "head_end"), Anchor(5, "turn_start", "user"),
            Anchor(40, "turn_start", "assistant")]
    assert sorted(ad.cut_points(main, [])) == [5, 40]
    sub = [*main, Anchor(42, "think_start"), Anchor(44, "think_end")]
    assert sorted(ad.cut_points(sub, [])) == [5, 42]


def test_user_breaks_only_for_a_leading_system_reminder(recs) -> None:
    ad = detect_adapter(_req(recs[0]))
    body = recs[0]["body"]
    first = body["messages"][0]["content"][0]["text"]
    assert ad.user_breaks(body) == [first.index("</system-reminder>") + 18]
    plain = {**body, "messages": [{"role": "user", "content": "hello </system-reminder>"}]}
    assert ad.user_breaks(plain) == []


def test_the_recording_replays_at_the_minimum(reqs) -> None:
    """The whole session (compaction, resume, re-sent sub-agents) through the proxy's path:
    within 0.2% of the unavoidable minimum at both budgets, where the imitated llama.cpp
    policy is 13% over."""
    for budget in ((64, 256), (16, 32)):
        ours = replay(reqs, "semantic+cuts", *budget).summary(1)
        base = replay(reqs, "llamacpp", *budget).summary(1)
        assert ours["ratio"] <= 1.002 and base["ratio"] > 1.1, (budget, ours, base)


def test_render_matches_the_proxys_normalised_body(tok, recs) -> None:
    """The bench replays what the proxy sends: the normalised body, so seq 11 renders with
    the session's model name (bug caught: it rendered the body as received, and the resume
    looked like a new system prompt 970 tokens in)."""
    a = _render(tok, recs[9]["path"], recs[9]["body"], recs[9]["headers"], "t", None)
    b = _render(tok, recs[10]["path"], recs[10]["body"], recs[10]["headers"], "t", None)
    assert _lcp(a.ids, b.ids) == len(a.ids) - 2 and a.session == b.session
