"""Native mode: the proxy renders, marks anchors and predicted cut points, and drives a real
`ft serve` app through /ft/v1/generate (over HTTP) whose engine is the scripted FakeEngine of the
server tests (a prefix-cache model: cached = longest common prefix with any earlier prompt)."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from server_helpers import FakeEngine, Server, parse_sse
from trace_replay import TRACES, harness_request, records

from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
from freetoken.proxy.app import create_proxy_app
from freetoken.proxy.config import ProxyConfig
from freetoken.server import anthropic_routes, create_app

REPLY = "<think>\nok\n</think>\n\nDone."
HOP = {"host", "content-length", "connection", "accept-encoding"}


@pytest.fixture(scope="module")
def stack():
    tok = ChatTokenizer.from_dir(qwen3_tokenizer_dir())
    engine = FakeEngine(tok, max_context=262144)
    serve = Server(create_app(engine, tok, api_key=None, served_model_names=["fake"]))
    state = {}

    def proxy(**kw) -> Server:
        if "p" in state:
            state["p"].stop()
        cfg = ProxyConfig(native_url=serve.url, **kw)
        state["p"] = Server(create_proxy_app(cfg, tok, "qwen3"))
        return state["p"]

    yield engine, proxy
    state["p"].stop()
    serve.stop()


def _send(url: str, rec: dict) -> httpx.Response:
    headers = {k: v for k, v in rec["headers"].items() if k.lower() not in HOP}
    return httpx.post(url + rec["path"], json=rec["body"], headers=headers, timeout=60)


def _stats(url: str) -> dict:
    return httpx.get(url + "/proxy/stats").json()


def test_claude_code_trace_gets_cut_points_sessions_and_growing_reuse(stack) -> None:
    engine, proxy = stack
    engine.reset()
    engine.script = lambda req: REPLY
    p = proxy(caps={"*": 16})
    for rec in records(TRACES / "claude_code" / "cc_try1.jsonl"):
        r = _send(p.url, rec)
        assert r.status_code == 200, r.text[:300]
        evs = [n for n, _ in parse_sse(r.text) if n not in ("#comment", "ping")]
        assert evs[0] == "message_start" and evs[-1] == "message_stop" and "error" not in evs
    reqs = engine.requests
    assert len(reqs) == 10
    keys = [r.session_key for r in reqs]
    assert len(set(keys)) == 3 and all(k.startswith("claude_code:") for k in keys)
    for r in reqs:  # head_end is always predicted, and predictions are anchors
        cuts = [a for a in r.anchors if a.cut_point]
        assert any(a.kind == "head_end" for a in cuts)
        assert r.sampling.max_tokens == 16
    main = [r for r in reqs if r.session_key == keys[0]]
    # lineage (#23): sub-agents name the main thread's session id as their parent
    assert all(r.parent_key is None for r in main)
    subs = [r for r in reqs if r.session_key != keys[0]]
    assert len(subs) == 4 and all(r.parent_key and keys[0].startswith(r.parent_key)
                                  for r in subs)
    st = _stats(p.url)
    sess = st["sessions"][keys[0]]
    assert sess["requests"] == len(main) == 6 and sess["appends"] == 5
    h = st["harnesses"]["claude_code"]
    assert h["edits"] == 2 and h["predicted_hit_rate"] == 1.0  # the sub-agents' think block
    assert h["normalised"]["strip_billing_header"] == 10
    assert h["cached_tokens"] > 0.75 * h["prompt_tokens"]  # only the 1st main request is cold


def test_openclaw_edits_are_predicted_and_reused_to_the_cut(stack, tmp_path) -> None:
    engine, proxy = stack
    engine.reset()
    engine.script = lambda req: REPLY
    p = proxy(caps={"*": 8}, metrics_path=str(tmp_path / "r.jsonl"))
    for rec in records(TRACES / "openclaw" / "ocl_try1.jsonl"):
        assert _send(p.url, rec).status_code == 200
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [x["edit_kind"] for x in lines] == ["new"] + ["edit"] * 5
    for x in lines[1:]:
        assert x["predicted_hit"] is True and x["edit_block"] == "turn_start(user)"
        # the engine reused the whole prompt up to the edit (prefix model), never less
        assert x["cached_tokens"] >= x["edit_position"] - 1
        assert x["recomputed_tokens"] == x["prompt_tokens"] - x["cached_tokens"]
        assert x["ttft_ms"] is not None and x["session"] == lines[0]["session"]
    cached = [x["cached_tokens"] for x in lines]
    assert cached == sorted(cached) and cached[-1] > cached[1] > 0


def test_cap_in_client_terms_both_apis(stack) -> None:
    """Regression: `max_tokens` 64000 against the demo model that never ends; the cap stops it
    and the client sees an ordinary end of turn."""
    engine, proxy = stack
    engine.reset()
    engine.script = lambda req: "word " * 200
    p = proxy(caps={"*": 12})
    r = httpx.post(p.url + "/v1/messages", json={
        "model": "claude-opus-4-8", "max_tokens": 64000,
        "messages": [{"role": "user", "content": "hi"}]})
    out = r.json()
    assert out["stop_reason"] == "end_turn" and out["usage"]["output_tokens"] == 12
    assert set(out["usage"]) >= {"input_tokens", "cache_read_input_tokens", "output_tokens"}
    assert r.headers["x-ft-output-cap"] == "12"
    r = httpx.post(p.url + "/v1/chat/completions", json={
        "model": "x", "messages": [{"role": "user", "content": "hi"}]})  # litellm: no limit
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert engine.requests[-1].sampling.max_tokens == 12
    r = httpx.post(p.url + "/v1/chat/completions", json={
        "model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["choices"][0]["finish_reason"] == "length"  # the client's own limit


def test_disconnect_aborts_the_engine_request(stack) -> None:
    engine, proxy = stack
    engine.reset()
    engine.script = lambda req: "word " * 2000
    engine.delay_s = 0.02
    p = proxy()
    with httpx.Client(timeout=10) as c, c.stream("POST", p.url + "/v1/chat/completions", json={
            "model": "x", "stream": True, "max_tokens": 4000,
            "messages": [{"role": "user", "content": "hi"}]}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    t0 = time.time()
    while not engine.aborted and time.time() - t0 < 5:
        time.sleep(0.02)
    assert engine.aborted == [engine.requests[-1].request_id]
    assert _stats(p.url)["harnesses"]["generic"]["requests"] == 1


def test_pings_before_the_first_token(stack, monkeypatch) -> None:
    engine, proxy = stack
    engine.reset()
    engine.first_delay_s = 0.4
    monkeypatch.setattr(anthropic_routes, "KEEPALIVE_S", 0.05)
    p = proxy()
    r = httpx.post(p.url + "/v1/messages", json={"model": "m", "max_tokens": 5, "stream": True,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    evs = parse_sse(r.text)
    first = next(i for i, (n, _) in enumerate(evs) if n == "message_start")
    # issue 28: `ping` events before message_start, not comments (events a harness can see)
    assert first >= 2 and all(n == "ping" for n, _ in evs[:first])


def test_count_tokens_models_and_bad_input(stack) -> None:
    engine, proxy = stack
    engine.reset()
    p = proxy(served_model_names=["claude-opus-4-8"])
    rec = records(TRACES / "claude_code" / "cc_try1.jsonl")[0]
    body = {k: rec["body"][k] for k in ("model", "system", "messages", "tools")}
    n = httpx.post(p.url + "/v1/messages/count_tokens", json=body,
                   headers={"user-agent": "claude-cli/2"}).json()["input_tokens"]
    assert 18000 < n < 20000
    assert httpx.get(p.url + "/v1/models").json()["data"][0]["id"] == "claude-opus-4-8"
    r = httpx.post(p.url + "/v1/messages", json={"model": "m", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(p.url + "/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": "x"}], "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    # refused by validation before any adapter ran (issue 22): recorded as "invalid"
    assert _stats(p.url)["harnesses"]["invalid"]["errors"] == 2


def test_request_is_detected_from_the_original_and_session_from_the_normalised(stack) -> None:
    """Two Claude Code sub-agent requests that differ only in the billing fingerprint are one
    session (the fingerprint is stripped before keying)."""
    engine, proxy = stack
    engine.reset()
    p = proxy(caps={"*": 4})
    rec = records(TRACES / "claude_code" / "cc_try1.jsonl")[3]
    a = harness_request(rec).body
    b = json.loads(json.dumps(a))
    b["system"][0]["text"] = "x-anthropic-billing-header: cc_version=9.9.9.zzz;"
    for body in (a, b):
        r = httpx.post(p.url + "/v1/messages", json={**body, "stream": False},
                       headers={"user-agent": "claude-cli/2", "x-claude-code-session-id": "S"})
        assert r.status_code == 200
    assert engine.requests[0].session_key == engine.requests[1].session_key
    assert engine.requests[0].input_ids == engine.requests[1].input_ids


def test_engine_behind_an_api_key(stack) -> None:
    """`--native-url` to an `ft serve --api-key K`: the proxy's configured key goes to the engine
    (the client's own key is not forwarded there); without it the client gets a 502."""
    engine, _ = stack
    engine.reset()
    tok = engine.tok
    serve = Server(create_app(engine, tok, api_key="engine-key", served_model_names=["f"]))
    servers = []
    try:
        for key, want in (("engine-key", 200), (None, 502)):
            cfg = ProxyConfig(native_url=serve.url, upstream_api_key=key)
            servers.append(Server(create_proxy_app(cfg, tok, "qwen3")))
            r = httpx.post(servers[-1].url + "/v1/chat/completions", json={
                "model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": "Bearer client-key"})
            assert r.status_code == want, r.text
    finally:
        for s in [*servers, serve]:
            s.stop()


def test_codex_threads_and_spawned_sub_agents_reach_the_engine(stack) -> None:
    """#23 item 1 through the proxy (Responses API, native mode): a Codex thread is keyed by
    its turn metadata's thread id, or without the metadata by `prompt_cache_key` (the same
    id); a spawned thread is its own session and names its parent thread, which resolves in
    the cache's lineage to the parent's key."""
    from freetoken.cache.lineage import Lineage

    engine, proxy = stack
    engine.reset()
    p = proxy()
    rec = records(TRACES / "codex" / "codex_responses.jsonl")[0]
    meta = json.loads(rec["headers"]["x-codex-turn-metadata"])
    root = meta["thread_id"]
    assert rec["body"]["prompt_cache_key"] == root
    child_meta = json.dumps(dict(meta, thread_id="child", parent_thread_id=root))
    no_meta = {k: v for k, v in rec["headers"].items()
               if k.lower() not in ("x-codex-turn-metadata", "session-id", "thread-id")}
    body = {**rec["body"], "client_metadata": None}
    for headers in (rec["headers"], no_meta, {**no_meta, "x-codex-turn-metadata": child_meta}):
        r = _send(p.url, {"path": rec["path"], "headers": headers, "body": body})
        assert r.status_code == 200, r.text[:300]
    main, again, child = engine.requests[-3:]
    assert main.session_key.startswith(f"codex:{root}:") and main.parent_key is None
    assert again.session_key == main.session_key and again.parent_key is None
    assert child.session_key.startswith("codex:child:") and child.parent_key == f"codex:{root}:"
    lin = Lineage()
    lin.begin(main.session_key)
    lin.end(main.session_key)
    lin.begin(child.session_key, child.parent_key)
    assert lin.sessions[child.session_key].parent == main.session_key
