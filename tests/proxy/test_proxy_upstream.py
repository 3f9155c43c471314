"""API mode against mocked upstreams (respx): translation both ways, streaming pass-through and
translated streams in the event order each client expects, the output cap in the client's terms,
errors in the client's shape, auth forwarding, client disconnects cancelling the upstream, and
concurrent streams."""
from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from server_helpers import parse_sse
from upstream_fakes import UP, Events, an_stream, oa_chunk, oa_stream, start_proxy

SSE = {"content-type": "text/event-stream"}
CC_HEADERS = {"user-agent": "claude-cli/2.1.197 (external, sdk-cli)",
              "x-claude-code-session-id": "s-1"}


def _cc_body(stream: bool, max_tokens: int = 64000) -> dict:
    return {"model": "claude-opus-4-8", "max_tokens": max_tokens, "stream": stream,
            "metadata": {"user_id": "u"}, "thinking": {"type": "adaptive"},
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"},
                       {"type": "text", "text": "You are helpful.",
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "read", "description": "read a file",
                       "input_schema": {"type": "object", "properties": {
                           "path": {"type": "string"}}}}],
            "messages": [{"role": "user", "content": "read the readme"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "hm", "signature": "sig"},
                             {"type": "tool_use", "id": "toolu_1", "name": "read",
                              "input": {"path": "a"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "A",
                              "cache_control": {"type": "ephemeral"}}]}]}


@pytest.fixture()
def to_openai():
    p = start_proxy({"upstream_api": "openai", "caps": {"claude_code": 100}, "ping_s": 0.05})
    yield p
    p.server.stop()


@pytest.fixture()
def to_anthropic():
    p = start_proxy({"upstream_api": "anthropic", "ping_s": 0.05})
    yield p
    p.server.stop()


def _on(p, path: str, respond) -> None:
    def side(request: httpx.Request) -> httpx.Response:
        p.seen.append(request)
        return respond(request)

    p.router.post(UP + path).mock(side_effect=side)


def test_anthropic_client_through_openai_upstream_non_stream(to_openai) -> None:
    p = to_openai
    _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, json={
        "id": "chatcmpl-9", "object": "chat.completion", "created": 1, "model": "up",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Reading.", "reasoning_content": "think",
            "tool_calls": [{"id": "call_Z", "type": "function", "function": {
                "name": "read", "arguments": "{\"path\": \"b\"}"}}]}}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 7, "total_tokens": 57,
                  "prompt_tokens_details": {"cached_tokens": 40}}}))
    r = httpx.post(p.url + "/v1/messages?beta=true", json=_cc_body(False),
                   headers={**CC_HEADERS, "x-api-key": "client-key"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use"]
    assert out["content"][2] == {"type": "tool_use", "id": "call_Z", "name": "read",
                                 "input": {"path": "b"}}
    assert out["stop_reason"] == "tool_use"
    # Anthropic convention: input_tokens excludes the cached ones, and nothing is missing
    assert out["usage"] == {"input_tokens": 10, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 40, "output_tokens": 7}
    sent = p.last_json()
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool"]
    assert sent["messages"][0]["content"] == "You are helpful."  # billing header stripped
    assert sent["messages"][2]["tool_calls"][0]["id"] == "toolu_1"  # ids kept verbatim
    assert sent["messages"][2]["reasoning_content"] == "hm"
    assert sent["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "A"}
    assert sent["max_tokens"] == 100 and "cache_control" not in json.dumps(sent)
    assert p.seen[-1].headers["authorization"] == "Bearer client-key"
    assert r.headers["x-ft-output-cap"] == "100"


def test_anthropic_sdk_stream_through_openai_upstream(to_openai) -> None:
    p = to_openai
    _on(p, "/v1/chat/completions", lambda r: httpx.Response(
        200, headers=SSE, stream=Events(oa_stream(), delay=0.002)))
    raw = httpx.post(p.url + "/v1/messages", json=_cc_body(True), headers=CC_HEADERS).text
    evs = [(n, d) for n, d in parse_sse(raw) if n not in ("#comment", "ping")]
    names = [n for n, _ in evs]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [(d["index"], d["content_block"]["type"]) for n, d in evs
              if n == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert names.count("content_block_stop") == 3
    for n, d in evs:  # no thinking_delta outside the thinking block, tool input never absent
        if n == "content_block_delta" and d["delta"]["type"] == "thinking_delta":
            assert d["index"] == 0
        if n == "content_block_start" and d["content_block"]["type"] == "tool_use":
            assert d["content_block"]["input"] == {} and d["content_block"]["id"] == "call_A"
    delta = evs[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"]["input_tokens"] == 20 and delta["usage"]["cache_read_input_tokens"] == 100
    # the official SDK accepts the stream and assembles the same message
    c = anthropic.Anthropic(base_url=p.url, api_key="k", default_headers=CC_HEADERS)
    with c.messages.stream(**{k: v for k, v in _cc_body(False).items()
                              if k not in ("stream", "metadata")}) as s:
        msg = s.get_final_message()
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[1].text == "Reading it." and msg.content[2].input == {"path": "README.md"}
    assert p.last_json()["stream_options"] == {"include_usage": True}


def test_openai_sdk_stream_through_anthropic_upstream(to_anthropic) -> None:
    p = to_anthropic
    _on(p, "/v1/messages", lambda r: httpx.Response(200, headers=SSE,
                                                      stream=Events(an_stream(), delay=0.002)))
    c = openai.OpenAI(base_url=p.url + "/v1", api_key="k")
    stream = c.chat.completions.create(
        model="m", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "read", "arguments": "{\"path\": \"x\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "X"}],
        tools=[{"type": "function", "function": {"name": "read", "parameters": {
            "type": "object"}}}])
    text, reasoning, args, finish, usage, ids = "", "", "", None, None, set()
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c0 in ch.choices:
            d = c0.delta
            text += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                ids.add(tc.id) if tc.id else None
                args += tc.function.arguments or ""
            finish = c0.finish_reason or finish
    assert (text, reasoning, finish) == ("Reading it.", "Let me look.", "tool_calls")
    assert json.loads(args) == {"path": "README.md"} and ids == {"toolu_A"}
    assert usage.prompt_tokens == 120 and usage.prompt_tokens_details.cached_tokens == 100
    sent = p.last_json()
    assert sent["system"] == "S" and sent["max_tokens"] == 4096
    assert sent["messages"][1]["content"][0]["type"] == "tool_use"
    assert sent["messages"][2]["content"] == [{"type": "tool_result", "tool_use_id": "call_1",
                                               "content": "X"}]
    assert p.seen[-1].headers["x-api-key"] == "k"  # the client's key, in the upstream's form


def test_same_api_stream_passes_events_through_unchanged() -> None:
    p = start_proxy({"upstream_api": "both"})
    try:
        frames = oa_stream("stop")
        _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, headers=SSE,
                                                                  stream=Events(frames)))
        body = {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "hi"}]}
        raw = httpx.post(p.url + "/v1/chat/completions", json=body).text
        assert raw == "".join(frames)
        st = p.stats()["harnesses"]["generic"]
        assert st["prompt_tokens"] == 120 and st["cached_tokens"] == 100
        # Was (issue 22): a client that did not ask for usage got the usage chunk the proxy
        # asked for (`choices: []`: code reading chunk.choices[0] raised). It is taken out,
        # and the metrics still have it.
        del body["stream_options"]
        _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, headers=SSE,
                                                                  stream=Events(frames)))
        raw = httpx.post(p.url + "/v1/chat/completions", json=body).text
        assert raw == "".join(f for f in frames if '"choices": []' not in f)
        assert p.last_json()["stream_options"] == {"include_usage": True}
        assert p.stats()["harnesses"]["generic"]["prompt_tokens"] == 240
    finally:
        p.server.stop()


def test_output_cap_is_reported_as_a_normal_end_of_turn(to_openai) -> None:
    """Regression: Claude Code asks for 64000 tokens; a model that never ends would run for
    minutes, and a capped reply reported as `max_tokens` becomes 'API Error: response exceeded
    the output token maximum'. The cap is applied and the turn ends normally."""
    p = to_openai
    frames = [oa_chunk({"role": "assistant"}), oa_chunk({"content": "blah"}),
              oa_chunk({}, "length"), "data: [DONE]\n\n"]
    _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, headers=SSE,
                                                              stream=Events(frames)))
    r = httpx.post(p.url + "/v1/messages", json=_cc_body(True), headers=CC_HEADERS)
    delta = next(d for n, d in parse_sse(r.text) if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "end_turn"
    assert p.last_json()["max_tokens"] == 100 and r.headers["x-ft-output-cap"] == "100"
    # a client limit below the cap is the client's own: left alone and reported as such
    _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, headers=SSE,
                                                              stream=Events(frames)))
    r = httpx.post(p.url + "/v1/messages", json=_cc_body(True, max_tokens=50),
                   headers=CC_HEADERS)
    delta = next(d for n, d in parse_sse(r.text) if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "max_tokens" and p.last_json()["max_tokens"] == 50


def test_errors_come_back_in_the_clients_shape(to_openai) -> None:
    p = to_openai
    _on(p, "/v1/chat/completions", lambda r: httpx.Response(
        400, json={"error": {"message": "prompt too long", "type": "invalid_request_error"}}))
    r = httpx.post(p.url + "/v1/messages", json=_cc_body(True), headers=CC_HEADERS)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "prompt too long" in r.json()["error"]["message"]
    r = httpx.post(p.url + "/v1/messages", content=b"{nope",
                   headers={**CC_HEADERS, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    bad = _cc_body(False)
    bad["messages"][0] = {"role": "user", "content": [{"type": "image", "source": {}}]}
    r = httpx.post(p.url + "/v1/messages", json=bad, headers=CC_HEADERS)
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    p.router.post(UP + "/v1/chat/completions").mock(side_effect=down)
    r = httpx.post(p.url + "/v1/messages", json=_cc_body(False), headers=CC_HEADERS)
    assert r.status_code == 502 and r.json()["error"]["type"] == "api_error"
    r = httpx.post(p.url + "/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": "x"}]})
    assert r.status_code == 502 and "error" in r.json() and "message" in r.json()["error"]


def test_keys_go_to_the_upstream_only_and_are_never_logged(caplog, tmp_path) -> None:
    p = start_proxy({"upstream_api": "both", "upstream_api_key": "server-secret",
                     "metrics_path": str(tmp_path / "m.jsonl")})
    try:
        _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, json={
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}], "usage": {"prompt_tokens": 3,
                                                              "completion_tokens": 1}}))
        with caplog.at_level(logging.DEBUG, logger="ft"):
            r = httpx.post(p.url + "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "x"}]},
                headers={"authorization": "Bearer client-secret"})
        assert r.status_code == 200
        assert p.seen[-1].headers["authorization"] == "Bearer server-secret"
        dump = (tmp_path / "m.jsonl").read_text() + caplog.text + json.dumps(p.stats())
        assert "client-secret" not in dump and "server-secret" not in dump
        assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])["harness"]
    finally:
        p.server.stop()


def test_client_disconnect_mid_stream_cancels_the_upstream(to_openai) -> None:
    p = to_openai
    up = Events(oa_stream()[:5], delay=0.01, forever=True)
    _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, headers=SSE, stream=up))
    with httpx.Client(base_url=p.url, timeout=10) as c, c.stream(
            "POST", "/v1/messages", json=_cc_body(True), headers=CC_HEADERS) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 8:
                break
    t0 = time.time()
    while not up.closed and time.time() - t0 < 5:
        time.sleep(0.02)
    assert up.closed, "the upstream stream was not closed after the client left"
    sent = up.sent
    time.sleep(0.1)
    assert up.sent <= sent + 1
    t0 = time.time()
    while p.stats()["requests"] < 1 and time.time() - t0 < 5:
        time.sleep(0.02)
    assert p.stats()["requests"] == 1


def test_pings_while_the_upstream_is_silent(to_openai) -> None:
    """Claude Code's stall watchdog: bytes must flow while the upstream queues or prefills.
    The upstream stays silent until the client has read two pings (a condition, not a delay:
    was flaky under load when the upstream spoke after a fixed 0.3 s)."""
    p = to_openai
    frames = oa_stream("stop")
    pings = []
    _on(p, "/v1/chat/completions", lambda r: httpx.Response(
        200, headers=SSE, stream=Events(frames[:3], gate=lambda: len(pings) >= 2)))
    raw = ""
    with httpx.stream("POST", p.url + "/v1/messages", json=_cc_body(True), headers=CC_HEADERS,
                      timeout=30) as r:
        for line in r.iter_lines():
            raw += line + "\n"
            if line.startswith(":") and "message_start" not in raw:
                pings.append(line)
    evs = parse_sse(raw)
    first = next(i for i, (n, _) in enumerate(evs) if n == "message_start")
    # issue 28: `ping` events before message_start, not comments (events a harness can see)
    assert first >= 2 and all(n == "ping" for n, _ in evs[:first])


def test_sibling_streams_are_served_concurrently(to_openai) -> None:
    """Sub-agents start ~40 ms apart: two streams are upstream at the same time, each waiting
    after its first frame until the other has started (a serialising proxy never lets both
    start: both would wait out the gate and the check fails), while a third that never ends
    (until the output cap) was opened before them. Was timed (< 1.1 s each), which a loaded
    machine broke."""
    p = to_openai
    endless = Events([oa_chunk({"role": "assistant"})], forever=True)
    started: list[Events] = []
    met = []

    def both_started() -> bool:
        if len(started) >= 2 and all(e.sent >= 1 for e in started):
            met.append(True)
        return bool(met)

    def respond(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if "endless" in json.dumps(body["messages"]):
            return httpx.Response(200, headers=SSE, stream=endless)
        ev = Events(oa_stream("stop"), gate=both_started, gate_after=1)
        started.append(ev)
        return httpx.Response(200, headers=SSE, stream=ev)

    _on(p, "/v1/chat/completions", respond)
    slow = _cc_body(True)
    slow["messages"] = [{"role": "user", "content": "endless"}]

    def run(body: dict) -> str:
        return httpx.post(p.url + "/v1/messages", json=body, headers=CC_HEADERS, timeout=60).text

    with httpx.Client(base_url=p.url, timeout=60) as c, c.stream(
            "POST", "/v1/messages", json=slow, headers=CC_HEADERS) as r:
        next(r.iter_lines())
        with ThreadPoolExecutor(2) as ex:
            texts = list(ex.map(run, [_cc_body(True), _cc_body(True)]))
    assert met, "the two streams were never upstream at the same time"
    assert all("message_stop" in t for t in texts)


def test_unknown_routes_and_methods_answer_in_the_clients_shape(to_openai) -> None:
    p = to_openai
    # (this used /v1/responses, a route since issue 28)
    r = httpx.post(p.url + "/v1/embeddings", json={}, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json()["type"] == "error"
    r = httpx.get(p.url + "/v1/chat/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


def test_the_proxys_own_key_is_required_and_never_forwarded() -> None:
    """Was (issue 22): the proxy had no key of its own, and with --upstream-api-key it unlocked
    a keyed server for any caller."""
    p = start_proxy({"upstream_api": "openai", "api_key": "proxy-key",
                     "upstream_api_key": "server-secret"})
    try:
        _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 1, "model": "up", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}]}))
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(p.url + "/v1/chat/completions", json=body).status_code == 401
        r = httpx.post(p.url + "/v1/messages", json={**body, "max_tokens": 4},
                       headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert not p.seen  # refused at the door: nothing reached the upstream
        r = httpx.post(p.url + "/v1/chat/completions", json=body,
                       headers={"authorization": "Bearer proxy-key"})
        assert r.status_code == 200
        assert p.seen[-1].headers["authorization"] == "Bearer server-secret"
        assert httpx.get(p.url + "/health").status_code == 200  # open
        assert httpx.get(p.url + "/proxy/stats").status_code == 401
    finally:
        p.server.stop()
    p = start_proxy({"upstream_api": "openai", "api_key": "proxy-key"})
    try:
        _on(p, "/v1/chat/completions", lambda r: httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 1, "model": "up", "choices": []}))
        httpx.post(p.url + "/v1/chat/completions", json=body,
                   headers={"authorization": "Bearer proxy-key"})
        assert "authorization" not in p.seen[-1].headers  # the proxy's key stays here
    finally:
        p.server.stop()
