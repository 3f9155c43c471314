"""Every adapter on the recorded traffic of its harness (tests/data/harness_traces): detection,
session keys, normalisation output, and predicted cut points against the divergence actually
observed in the next request of the session (the real Qwen3 template and tokenizer)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from trace_replay import (
    EXPECTED,
    FILES,
    TRACES,
    harness_request,
    hit_rates,
    records,
    replay,
    tokenizer,
)

from freetoken.chat import anthropic_to_template, openai_to_template
from freetoken.proxy.sessions import SessionStore
from harness_adapters import ADAPTERS, HarnessRequest, detect_adapter
from harness_adapters.swe_agent import SWEAgent

pytestmark = pytest.mark.skipif(not FILES, reason="harness traces not present")
# oc_prune grows to 144k tokens per request; seq 13 prunes tool results that seq 3 already
# carried in full, so 3 -> 13 shows the same edit at a fraction of the tokenizing time
SUBSET = {"oc_prune": {1, 2, 3, 13}}


@pytest.fixture(scope="module")
def steps() -> dict[Path, list]:
    return {f: replay(f, SUBSET.get(f.stem)) for f in FILES}


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_detection(path: Path) -> None:
    want = EXPECTED[path.parent.name]
    got = {detect_adapter(harness_request(r)).name for r in records(path)}
    assert got == {want}


def test_generic_is_last_and_claims_anything() -> None:
    assert ADAPTERS[-1].name == "generic"
    req = HarnessRequest("openai", "/v1/chat/completions", {"user-agent": "curl/8"},
                         {"messages": [{"role": "user", "content": "hi"}]})
    assert detect_adapter(req).name == "generic"


def test_session_keys(steps) -> None:
    """Claude Code: main agent and each sub-agent (same header) get their own key; OpenCode:
    title request, main session and each child session; OpenClaw and mini: one session."""
    keys = {f.stem: [s.session for s in st] for f, st in steps.items()}
    cc = keys["cc_try1"]
    assert len(set(cc)) == 3 and cc[0] == cc[1] == cc[2] == cc[7] == cc[9]
    assert cc[3] == cc[5] and cc[4] == cc[6] and cc[3] != cc[4]  # siblings sent ~40 ms apart
    oc = keys["oc_try1"]
    assert len(set(oc)) == 4 and oc[0] != oc[1] and oc[4] != oc[5]
    for stem in ("ocl_try1", "ocl_anth", "mini_text", "mini_tool"):
        assert len(set(keys[stem])) == 1, stem
    assert all("redacted" not in k and "sk-" not in k for ks in keys.values() for k in ks)


def test_session_key_is_not_truncated_json_metadata() -> None:
    """Regression (a proxy keyed sessions on metadata.user_id cut to 64 chars: all equal)."""
    base = {"messages": [{"role": "user", "content": "task A"}], "metadata": {
        "user_id": json.dumps({"device_id": "d" * 64, "session_id": "s1"})}}
    other = {**base, "messages": [{"role": "user", "content": "task B"}]}
    ad = detect_adapter(HarnessRequest("anthropic", "/v1/messages", {}, base))
    k1 = ad.session_key(HarnessRequest("anthropic", "/v1/messages", {}, base))
    k2 = ad.session_key(HarnessRequest("anthropic", "/v1/messages", {}, other))
    assert k1 != k2


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_normalisation_never_changes_the_prompt(path: Path) -> None:
    """Every default step is meaning-preserving: the rendered prompt of the normalised body is
    the prompt of the body as sent (our mapping already ignores these non-tokens), while the
    normalised JSON lost what breaks prefix matching in other engines."""
    tok = tokenizer()
    for rec in records(path)[:3]:
        req = harness_request(rec)
        # unify_model_suffix (on for Claude Code, #23) does change the text: the model's name
        # loses its 1M-context suffix, as a resumed session writes it
        body, fired = detect_adapter(req).normalise(req, {"unify_model_suffix": False})
        fn = anthropic_to_template if req.api == "anthropic" else openai_to_template
        a, b = fn(rec["body"]), fn(body)
        assert tok.render(a.messages, a.tools, a.enable_thinking) == tok.render(
            b.messages, b.tools, b.enable_thinking)
        text = json.dumps(body)
        assert "cache_control" not in text and "x-anthropic-billing-header" not in text
        assert "metadata" not in body
        if path.parent.name == "claude_code":
            assert fired["strip_billing_header"] == 1 and fired["drop_metadata"] == 1
        assert rec["body"] != body or not fired  # the recorded body itself is untouched


def test_predicted_cuts_hit_the_observed_edits(steps) -> None:
    """Per harness: every edit observed in the traces falls in a block whose start the adapter
    predicted (hit rate 1.0 where the harness edits; mini-swe-agent only appends)."""
    rates = hit_rates(steps)
    print("hit rates", rates)
    assert rates["openclaw"]["edits"] == 10 and rates["openclaw"]["hits"] == 10
    assert rates["opencode"]["edits"] == 1 and rates["opencode"]["hits"] == 1  # prune, seq 13
    # cc_try1: its 2 sub-agents' second requests (the reply's reasoning where the prompt had
    # an empty <think>); cc_compact (#23): the same 2, the compaction request (it parts from
    # the latest prompt at its generation prompt) and the 2 re-sent sub-agents' second requests
    assert rates["claude_code"]["edits"] == 7 and rates["claude_code"]["hits"] == 7
    assert rates["swe_agent"]["edits"] == 0 and rates["swe_agent"]["appends"] == 10


def test_opencode_prune_edit_is_at_the_first_cleared_tool_result(steps) -> None:
    prune = [s for s in steps[TRACES / "opencode" / "oc_prune.jsonl"] if s.edit.kind == "edit"]
    assert len(prune) == 1 and prune[0].edit.block == "tool_result_start"
    assert prune[0].edit.prev_len > 20_000 and prune[0].edit.position < 8000


def _elide(body: dict, keep_last: int) -> dict:
    """SWE-agent's LastNObservations on an OpenAI body: tool observations except the first and
    the last `keep_last` become 'Old environment output: (N lines omitted)'."""
    out = json.loads(json.dumps(body))
    tools = [m for m in out["messages"] if m["role"] == "tool"]
    for m in tools[1:len(tools) - keep_last]:
        m["content"] = f"Old environment output: ({m['content'].count(chr(10)) + 1} lines omitted)"
    return out


def test_swe_agent_elision_is_predicted() -> None:
    """mini-swe-agent does not elide; SWE-agent does. Apply its LastNObservations (n=2) to the
    mini tool-protocol trace: each new elision lands on the predicted tool_result_start."""
    ad = SWEAgent()
    ad.keep_last = 2
    tok = tokenizer()
    prev = None
    judged = hits = 0
    for rec in records(TRACES / "mini_swe_agent" / "mini_tool.jsonl"):
        body = _elide(rec["body"], ad.keep_last)
        ti = openai_to_template(body)
        p = tok.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking)
        if prev is not None:
            ids, anchors, cuts = prev
            d = next((i for i, (a, b) in enumerate(zip(ids, p.input_ids)) if a != b), None)
            if d is not None:
                judged += 1
                block = max(a.position for a in anchors if a.position <= d)
                hits += block in cuts
        prev = (p.input_ids, p.anchors, set(ad.cut_points(p.anchors, ti.messages)))
    assert judged >= 2 and hits == judged


# what mini-swe-agent 2.4.6 appends in place of a reply it cannot parse (recorded against the
# demo model behind `ft agent-proxy --model demo`, 2026-12-02)
FORMAT_ERROR = ("Tool call error:\n\n<error>\nNo tool calls found in the response. Every "
                "response MUST include at least one tool call.\n</error>\n\nHere is general "
                "guidance on how to submit correct toolcalls:\n\nEvery response needs to use "
                "the 'bash' tool at least once to execute commands.")


@pytest.mark.parametrize("trace", ["mini_tool", "mini_text"])
def test_mini_format_error_edit_is_predicted(trace: str) -> None:
    """Regression (issue 28): mini drops a reply it cannot parse and appends its error as a user
    turn, so the prompt parts inside the previous generation prompt; every such edit was
    unpredicted and `/proxy/stats` showed mini's hit rate as 0.0 at 87-89% reuse."""
    rec = records(TRACES / "mini_swe_agent" / f"{trace}.jsonl")[0]
    req = harness_request(rec)
    ad = detect_adapter(req)
    assert ad.name == "swe_agent"
    nxt = {**rec["body"], "messages": rec["body"]["messages"]
           + [{"role": "user", "content": FORMAT_ERROR}]}
    tok = tokenizer()
    ps = []
    for body in (rec["body"], nxt):
        ti = openai_to_template(body)
        p = tok.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking)
        ps.append((p, ad.cut_points(p.anchors, ti.messages)))
    (p0, cuts0), (p1, _) = ps
    store = SessionStore()
    store.observe_tokens("s", p0.input_ids, p0.anchors, cuts0)
    ep = store.observe_tokens("s", p1.input_ids, p1.anchors, [])
    assert ep.kind == "edit" and ep.block == "turn_start(assistant)"
    assert len(p0.input_ids) - ep.position <= 3  # inside the generation prompt
    assert ep.predicted_hit is True


def test_cut_points_are_anchor_positions(steps) -> None:
    for st in steps.values():
        for s in st:
            assert s.cuts and set(s.cuts) <= {a.position for a in s.anchors}
