"""Cross-session reuse of the stable head: a new session of the same harness started in another
directory (or on another day) resumes from a `system_block` state snapshot where its system
prompt parts from the earlier session's, instead of recomputing the whole prompt.

Bug caught (issue 11, measured with the real harnesses on the demo model): a new OpenCode /
OpenClaw session in another directory matched 1,819 / 3,405 tokens of the earlier session in
KV and reused 0, because no recurrent-state snapshot lay at or below the match (the semantic
policy's first fill point is at 4,096 tokens, its anchors at the end of the system prompt).

The sessions go through the real native proxy (the adapters' head breaks become anchors of the
native request); the engine is the scripted FakeEngine, and the reuse is what the hybrid radix
cache under the semantic policy gives for exactly the requests the engine received
(`freetoken.bench.anchor_sim.replay`). The oracle is independent of both: the longest common
prefix of the second session's prompt with any earlier prompt, on the rendered ids.
"""
from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import FakeEngine, Server
from trace_replay import TRACES, records, replay

from freetoken.bench.anchor_sim import SimRequest
from freetoken.bench.anchor_sim import replay as cache_replay
from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
from freetoken.proxy.app import create_proxy_app
from freetoken.proxy.config import ProxyConfig
from freetoken.proxy.sessions import first_divergence
from freetoken.server import create_app

HOP = {"host", "content-length", "connection", "accept-encoding"}
HERE, ELSEWHERE = "/home/dev/project", "/home/dev/other-checkout"
# (earlier session's trace, its requests; the trace and request of the new session)
CASES = {
    "claude_code": ("claude_code/cc_try1", {1, 2, 3}, "claude_code/cc_try1", 1),
    "opencode": ("opencode/oc_prune", {1, 2, 3}, "opencode/oc_try1", 2),
    "openclaw": ("openclaw/ocl_anth", None, "openclaw/ocl_try1", 1),
}
SECTION = 32  # the heading and first words of the section that differs (CC: 22 tokens)


def elsewhere(body: dict) -> dict:
    return json.loads(json.dumps(body).replace(HERE, ELSEWHERE))


@pytest.fixture(scope="module")
def stack():
    tok = ChatTokenizer.from_dir(qwen3_tokenizer_dir())
    engine = FakeEngine(tok, max_context=262144)
    serve = Server(create_app(engine, tok, api_key=None, served_model_names=["fake"]))
    proxy = Server(create_app_proxy(serve.url, tok))
    yield engine, proxy
    proxy.stop()
    serve.stop()


def create_app_proxy(url: str, tok: ChatTokenizer):
    return create_proxy_app(ProxyConfig(native_url=url, caps={"*": 4}), tok, "qwen3")


def _send(c: httpx.Client, rec: dict) -> None:
    headers = {k: v for k, v in rec["headers"].items() if k.lower() not in HOP}
    r = c.post(rec["path"], json=rec["body"], headers=headers)
    assert r.status_code == 200, r.text[:300]


def _run(stack, harness: str) -> tuple[list[SimRequest], int]:
    """Both sessions through the proxy; the engine's requests as cache-replay input, and the
    longest prefix the new session's request shares with an earlier prompt."""
    engine, proxy = stack
    engine.reset()
    first, seqs, second, seq = CASES[harness]
    with httpx.Client(base_url=proxy.url, timeout=60) as c:
        for rec in records(TRACES / f"{first}.jsonl"):
            if "count_tokens" not in rec["path"] and (seqs is None or rec["seq"] in seqs):
                _send(c, rec)
        new = next(r for r in records(TRACES / f"{second}.jsonl") if r["seq"] == seq)
        _send(c, {**new, "body": elsewhere(new["body"])})
    reqs = [SimRequest(r.session_key or "", list(r.input_ids), list(r.anchors))
            for r in engine.requests]
    last = reqs[-1].ids
    lcp = max(first_divergence(r.ids, last) for r in reqs[:-1])
    return reqs, lcp


@pytest.mark.parametrize("harness", sorted(CASES))
@pytest.mark.parametrize("slots", [(64, 256), (16, 32), (16, 0)], ids=["64+256", "16+32", "16+0"])
def test_new_session_elsewhere_resumes_at_the_shared_head(stack, harness, slots) -> None:
    reqs, lcp = _run(stack, harness)
    assert lcp >= 512, "the sessions must share a head for this test to mean anything"
    assert reqs[-1].session not in {r.session for r in reqs[:-1]}  # a new session
    got = cache_replay(reqs, "semantic", *slots)
    reused = len(reqs[-1].ids) - got.recomputed[-1]
    assert lcp - SECTION <= reused <= lcp, (harness, reused, lcp)


def test_engine_gets_the_system_blocks_the_trace_replay_expects(stack) -> None:
    """The native request carries a `system_block` anchor (not a predicted cut) at each head
    break; the trace replay (`trace_replay.replay`, the e2e reference) computes the same ones."""
    engine, _ = stack
    reqs, _ = _run(stack, "openclaw")
    steps = replay(TRACES / "openclaw/ocl_anth.jsonl") + replay(
        TRACES / "openclaw/ocl_try1.jsonl", {1}, elsewhere)
    assert len(reqs) == len(steps)
    for r, s in zip(reqs, steps):
        assert [(a.position, a.kind) for a in r.anchors] == [
            (a.position, a.kind) for a in s.anchors]
    blocks = [a for a in engine.requests[0].anchors if a.kind == "system_block"]
    # the deferred tool list (#23: an announce turn drops a tool there), the working directory,
    # the per-session block
    assert len(blocks) == 3 and not any(a.cut_point for a in blocks)
