"""The recorded Claude Code session (tests/data/harness_traces/claude_code, Claude Code 2.1 against
a real model) replayed through `ft agent-proxy --upstream URL` onto llama-cpp-python's server,
which has only the chat API: every Anthropic stream is translated from the peer's OpenAI
stream. Per request: the translated stream is emitted exactly once, in the Anthropic event
order, and reports the prompt once (issue 28: a second message_start ... message_stop made
Claude Code count twice the input tokens). Across the main thread's turns: the proxy records
an append and the peer's own counter (its `prefix-match hit` log line) reuses the previous
turn's whole prompt, i.e. the translation renders history byte-stably."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from peer_stack import PEER_SKIP, metrics, peer_prefix_hits, start_peer, start_proxy, tiny_model
from server_helpers import parse_sse

pytestmark = [pytest.mark.slow, pytest.mark.skipif(PEER_SKIP is not None,
                                                   reason=PEER_SKIP or "")]
TRACE = Path(__file__).parents[1] / "data" / "harness_traces" / "claude_code" / "cc_try1.jsonl"
DROP = {"host", "content-length", "connection", "accept-encoding", "x-api-key"}
ORDER = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
         "message_delta", "message_stop")


def _main_thread() -> list[dict]:
    """The main agent's requests in order (the full tool set; sub-agents have fewer tools)."""
    recs = [json.loads(x) for x in TRACE.read_text().splitlines() if x.strip()]
    msgs = [r for r in recs if r["path"].startswith("/v1/messages") and
            "count_tokens" not in r["path"]]
    most = max(len(r["body"].get("tools") or []) for r in msgs)
    return [r for r in msgs if len(r["body"].get("tools") or []) == most]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    _, gguf = tiny_model()
    d = tmp_path_factory.mktemp("peer_cc")
    peer = start_peer(gguf, d, n_ctx=32768)
    proxy = start_proxy(peer.url, d)
    yield peer, proxy
    proxy.stop()
    peer.stop()


def _check_stream(text: str) -> int:
    """The Anthropic event order, each part once; returns message_start's input_tokens."""
    evs = [(e, d) for e, d in parse_sse(text) if e not in ("#comment", "ping")]
    names = [e for e, _ in evs]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    for once in ("message_start", "message_delta", "message_stop"):
        assert names.count(once) == 1, names
    assert set(names) <= set(ORDER) and _blocks_nest(names), names
    return int(evs[0][1]["message"]["usage"]["input_tokens"])


def _blocks_nest(names: list[str]) -> bool:
    """content blocks open, stream, close, one after another, between start and delta."""
    depth = 0
    for n in names[1:-2]:
        depth += {"content_block_start": 1, "content_block_stop": -1}.get(n, 0)
        if depth not in (0, 1) or (n == "content_block_delta" and depth != 1):
            return False
    return depth == 0 and names[-2] == "message_delta"


def test_claude_code_session_replayed_once_each_and_append_only(stack) -> None:
    peer, proxy = stack
    reqs = _main_thread()
    assert len(reqs) >= 4
    n0 = len(metrics(proxy))
    starts = []
    for rec in reqs:
        headers = {k: v for k, v in rec["headers"].items() if k.lower() not in DROP}
        body = {**rec["body"], "max_tokens": 16}  # the reply is random text: keep it short
        r = httpx.post(proxy.url + rec["path"], headers=headers, json=body, timeout=300)
        assert r.status_code == 200, r.text[:2000]
        starts.append(_check_stream(r.text))
    recs = [x for x in metrics(proxy)[n0:] if x["path"].startswith("/v1/messages")]
    assert len(recs) == len(reqs)
    assert {x["harness"] for x in recs} == {"claude_code"}
    assert all(x["status"] == 200 and x["error"] is None for x in recs)
    assert [x["edit_kind"] for x in recs][1:] == ["append"] * (len(recs) - 1), recs
    prompts = [x["prompt_tokens"] for x in recs]
    assert all(p and p > 5000 for p in prompts), prompts
    # the input tokens Claude Code sees are the peer's prompt, once (never doubled)
    assert all(s <= p for s, p in zip(starts, prompts, strict=True)), (starts, prompts)
    # the peer's own counter: each later turn matched all of the previous turn's prompt
    # (llama-cpp-python keeps one sequence; the previous reply is ours, not the trace's, so the
    # match ends at or after the previous prompt's end, less the replayed last token)
    hits = peer_prefix_hits(peer)[-(len(reqs) - 1):]
    assert len(hits) == len(reqs) - 1, peer.log.read_text()[-3000:]
    for prev, (matched, remaining) in zip(prompts, hits, strict=True):
        assert matched >= 0.95 * prev, (prompts, hits)
    # an upstream without cached-token counters: reuse is unknown, not 0
    assert all(x["cached_tokens"] is None for x in recs), [x["cached_tokens"] for x in recs]
