"""Anchors at the divergences the recorded harnesses make (#23 item 3), on held-out-style
variants derived from the recorded bodies in `tests/data/harness_traces` (the oracle: the
longest prefix the variant's prompt shares with the original's, and the recompute the bench's
replay of the engine reports)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from freetoken.bench.anchor_sim import replay
from freetoken.bench.cli_anchors import adapter_cuts, head_breaks
from freetoken.bench.traces import _render, attribute_replies
from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
from harness_adapters import HarnessRequest, detect_adapter

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen3_tokenizer_dir())


def _records(name: str) -> list[dict]:
    return [json.loads(x) for x in (TRACES / name).read_text().splitlines()]


def _normalised(rec: dict) -> dict:
    api = "anthropic" if rec["path"].startswith("/v1/messages") else "openai"
    req = HarnessRequest(api, rec["path"], {k.lower(): v for k, v in rec["headers"].items()},
                         rec["body"])
    return detect_adapter(req).normalise(req)[0]


def _lcp(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_claude_code_resume_without_the_1m_suffix_keeps_the_whole_prefix() -> None:
    """Bug caught: a resumed Claude Code session writes the model as `Opus 4.8` /
    `claude-opus-4-8` where the session had `Opus 4.8 (1M context)` / `claude-opus-4-8[1m]`;
    `unify_model_suffix` (off) repaired only `[1m]`, so the resume parted from the session
    inside the system prompt."""
    rec = _records("claude_code/cc_try1.jsonl")[1]
    resumed = copy.deepcopy(rec)
    blocks = resumed["body"]["system"]
    assert any("(1M context)" in b["text"] and "[1m]" in b["text"] for b in blocks)
    for b in blocks:  # what the resume writes in the system prompt
        b["text"] = b["text"].replace(" (1M context)", "").replace("claude-opus-4-8[1m]",
                                                                     "claude-opus-4-8")
    assert _normalised(rec)["system"] != rec["body"]["system"]
    assert _normalised(rec)["system"] == _normalised(resumed)["system"]


def test_openclaw_siblings_part_at_their_session_label_with_a_head_anchor(tok) -> None:
    """OpenClaw sibling sub-agents differ at `## Session Context\\n- Label: ...`: without a head
    break there the second sibling resumed at the system block before it (538 tokens lost)."""
    rec = _records("openclaw/ocl_try1.jsonl")[0]
    body = rec["body"]
    sys0 = body["messages"][0]["content"]
    assert "## Session Context" not in sys0
    heads = head_breaks(tok)

    def sibling(label: str) -> dict:
        b = copy.deepcopy(body)
        at = sys0.index("## Workspace")  # the label section sits late in the system prompt
        b["messages"][0]["content"] = (sys0[:at] + f"## Session Context\n- Label: {label}\n"
                                       "- Spawned by: main\n\n" + sys0[at:])
        return b

    reqs = [_render(tok, rec["path"], sibling(x), rec["headers"], "t", adapter_cuts, heads)
            for x in ("review the parser", "write the tests")]
    reqs[1].session = "t/other"  # its own session
    attribute_replies(reqs, tok.special_ids["<|im_end|>"])
    lcp = _lcp(reqs[0].ids, reqs[1].ids)
    assert lcp < len(reqs[1].ids) - 1000  # they part inside the system prompt
    r = replay(reqs, "semantic+cuts", device_slots=64, host_slots=256)
    assert lcp - 24 <= len(reqs[1].ids) - r.recomputed[1] <= lcp


def test_a_codex_sub_agent_names_its_parent_thread() -> None:
    """#23 item 1: Codex's turn metadata names a spawned thread's parent. Bug caught: the Codex
    adapter (which claims Codex's requests before `generic`) had no `parent_key`, so a Codex
    sub-agent reached the engine without its lineage."""
    from freetoken.cache.lineage import Lineage

    rec = _records("codex/codex_responses.jsonl")[0]
    headers = {k.lower(): v for k, v in rec["headers"].items()}
    main = HarnessRequest("openai", "/v1/responses", headers, rec["body"])
    meta = json.loads(headers["x-codex-turn-metadata"])
    child_meta = dict(meta, thread_id="child-thread", parent_thread_id=meta["thread_id"])
    child = HarnessRequest("openai", "/v1/responses",
                           dict(headers, **{"x-codex-turn-metadata": json.dumps(child_meta)}),
                           rec["body"])
    ad = detect_adapter(main)
    assert ad.name == "codex" and detect_adapter(child) is ad
    assert ad.parent_key(main) is None
    parent_key, main_key = ad.parent_key(child), ad.session_key(main)
    assert parent_key is not None and main_key.startswith(parent_key)
    assert ad.session_key(child) != main_key
    lin = Lineage()
    lin.begin(main_key)
    lin.end(main_key)
    lin.begin(ad.session_key(child), parent_key)
    assert lin.sessions[ad.session_key(child)].parent == main_key
    assert lin.waiting_on_children(main_key)
