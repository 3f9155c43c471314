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


def _send(proxy, rec: dict, stream: bool) -> httpx.Response:
    headers = {k: v for k, v in rec["headers"].items() if k.lower() not in DROP}
    body = {**rec["body"], "max_tokens": 16, "stream": stream}  # random text: keep it short
    r = httpx.post(proxy.url + rec["path"], headers=headers, json=body, timeout=600)
    assert r.status_code == 200, r.text[:2000]
    return r


def test_claude_code_session_replayed_once_each_and_append_only(stack) -> None:
    peer, proxy = stack
    reqs = _main_thread()
    assert len(reqs) >= 4
    # the first turn once non-streamed: the peer's prompt size in its own usage (llama-cpp-python
    # streams carry no usage)
    first = _send(proxy, reqs[0], stream=False).json()
    assert first["type"] == "message" and first["usage"]["input_tokens"] > 5000, first
    n0 = len(metrics(proxy))
    starts = [_check_stream(_send(proxy, rec, stream=True).text) for rec in reqs]
    recs = [x for x in metrics(proxy)[n0:] if x["path"].startswith("/v1/messages")]
    assert len(recs) == len(reqs)
    assert {x["harness"] for x in recs} == {"claude_code"}
    assert all(x["status"] == 200 and x["error"] is None for x in recs)
    # reqs[0] again, then each turn appends to the previous one
    assert [x["edit_kind"] for x in recs][1:] == ["append"] * (len(recs) - 1), recs
    # the peer's own counter, one line per streamed request: each matched all of the previous
    # prompt (llama-cpp-python keeps one sequence; the previous reply in its cache is the random
    # model's, not the trace's, so a match ends at the previous prompt's end, less the one
    # token it replays when a prompt is wholly cached)
    hits = peer_prefix_hits(peer)
    assert len(hits) == len(reqs), peer.log.read_text()[-3000:]
    sizes = [m + r for m, r in hits]
    assert sizes[0] == first["usage"]["input_tokens"]  # streamed and not: the same prompt
    prev = [sizes[0], *sizes[:-1]]
    for p, (matched, _) in zip(prev, hits, strict=True):
        assert matched >= p - 1, (sizes, hits)  # measured: 18,860/18,861, then every token
    # the input tokens a client sees are at most the prompt, never twice it
    assert all(s <= z for s, z in zip(starts, sizes, strict=True)), (starts, sizes)
    # an upstream without cached-token counters: reuse is unknown, not 0
    assert all(x["cached_tokens"] is None for x in recs), [x["cached_tokens"] for x in recs]
