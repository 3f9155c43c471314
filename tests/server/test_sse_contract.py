"""Wire contracts of the streams, read with raw httpx: the exact Anthropic event order and
usage fields, pings on silence, OpenAI chunk shapes, errors after a stream started, and aborts
on client disconnect."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_helpers import API_KEY, FakeEngine, Server, parse_sse

from freetoken.server import anthropic_routes, openai_routes

H = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
SCRIPT = ('<think>\nA plan.\n</think>\n\nRunning it.\n<tool_call>\n{"name": "Bash", "arguments": '
          '{"command": "ls"}}\n</tool_call>\n<tool_call>\n{"name": "Bash", "arguments": '
          '{"command": "pwd"}}\n</tool_call>')
TOOLS = [{"name": "Bash", "input_schema": {"type": "object",
                                           "properties": {"command": {"type": "string"}}}}]


def anthropic_stream(server: Server, body: dict, **kw: object) -> list:
    r = httpx.post(server.url + "/v1/messages?beta=true", json=body, headers=H, timeout=30, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return parse_sse(r.text)


def test_anthropic_event_order(server: Server, engine: FakeEngine) -> None:
    engine.script = lambda req: SCRIPT
    evs = [e for e in anthropic_stream(server, {
        "model": "claude-opus-4-8", "max_tokens": 64000, "stream": True, "tools": TOOLS,
        "thinking": {"type": "adaptive"}, "metadata": {"user_id": "u"},
        "context_management": {"edits": []}, "output_config": {"effort": "high"},
        "messages": [{"role": "user", "content": "go"}]}) if e[0] != "#comment"]
    for name, data in evs:
        assert data["type"] == name  # the event line always names the data's type
    names = [n for n, _ in evs]
    deltas = [d["delta"]["type"] for n, d in evs if n == "content_block_delta"]
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert collapsed == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",  # thinking
        "content_block_start", "content_block_delta", "content_block_stop",  # text
        "content_block_start", "content_block_delta", "content_block_stop",  # tool_use
        "content_block_start", "content_block_delta", "content_block_stop",  # tool_use
        "message_delta", "message_stop"]
    assert [d for d in deltas if d not in ("thinking_delta", "text_delta")] == [
        "signature_delta", "input_json_delta", "input_json_delta"]
    # signature_delta is the last delta of the thinking block, right before its stop
    i = names.index("content_block_stop")
    assert evs[i - 1][1]["delta"]["type"] == "signature_delta"
    starts = [d for n, d in evs if n == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2, 3]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use",
                                                            "tool_use"]
    assert starts[2]["content_block"]["input"] == {}
    args = [json.loads(d["delta"]["partial_json"]) for n, d in evs
            if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert args == [{"command": "ls"}, {"command": "pwd"}]
    msg = evs[0][1]["message"]
    assert msg["role"] == "assistant" and msg["content"] == [] and msg["stop_reason"] is None
    n = len(engine.requests[-1].input_ids)
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == n
    md = evs[-2][1]
    assert md["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert md["usage"]["output_tokens"] == len(engine.tok.encode(SCRIPT)) + 1


def test_anthropic_pings_on_silence(server: Server, engine: FakeEngine,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(anthropic_routes, "KEEPALIVE_S", 0.1)
    engine.script = lambda req: "slow words come out here"
    engine.per_event, engine.delay_s, engine.first_delay_s = 2, 0.35, 0.35
    evs = anthropic_stream(server, {"model": "m", "max_tokens": 50, "stream": True,
                                    "messages": [{"role": "user", "content": "x"}]})
    names = [n for n, _ in evs]
    start = names.index("message_start")
    # silence before message_start: `ping` events (issue 28: a harness that watches events, not
    # bytes, saw nothing while the engine prefilled; the SDKs skip `ping` wherever it falls)
    assert start > 0 and set(names[:start]) == {"ping"}
    assert names[start + 1] == "ping"  # the early ping, like the real API
    text_at = [i for i, (n, d) in enumerate(evs) if n == "content_block_delta"]
    between = names[text_at[0]:text_at[-1]]
    assert between.count("ping") >= len(text_at) - 1  # a ping in each silent gap


def test_openai_chunks(server: Server, engine: FakeEngine) -> None:
    engine.script = lambda req: "<think>\nr\n</think>\n\nok"
    r = httpx.post(server.url + "/v1/chat/completions",
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "m", "stream": True, "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": "x"}]})
    evs = parse_sse(r.text)
    assert evs[-1] == (None, "[DONE]")
    chunks = [d for _, d in evs[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == (
        chunks[-1]["usage"]["prompt_tokens"] + chunks[-1]["usage"]["completion_tokens"])
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])


def test_error_after_stream_started(server: Server, engine: FakeEngine) -> None:
    engine.script = lambda req: "some words that never all arrive"
    engine.per_event, engine.abort_after = 1, 3
    evs = anthropic_stream(server, {"model": "m", "max_tokens": 50, "stream": True,
                                    "messages": [{"role": "user", "content": "x"}]})
    assert evs[0][0] == "message_start" and evs[-1][0] == "error"
    assert evs[-1][1]["type"] == "error" and evs[-1][1]["error"]["type"] == "overloaded_error"
    r = httpx.post(server.url + "/v1/chat/completions",
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "m", "stream": True,
                         "messages": [{"role": "user", "content": "x"}]})
    evs = parse_sse(r.text)
    assert evs[-1] == (None, "[DONE]") and evs[-2][1]["error"]["code"] == "engine_abort"
    # non-streamed: a 503 in the API's error shape
    r = httpx.post(server.url + "/v1/messages", headers=H,
                   json={"model": "m", "max_tokens": 50,
                         "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["type"] == "error"


def _wait_for(cond: object, timeout: float = 3.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/ft/v1/generate"])
def test_disconnect_mid_stream_aborts(server: Server, engine: FakeEngine, path: str) -> None:
    engine.script = lambda req: "word " * 400
    engine.per_event, engine.delay_s = 1, 0.02
    body = {"model": "m", "max_tokens": 1000, "stream": True,
            "messages": [{"role": "user", "content": "x"}]}
    if path == "/ft/v1/generate":
        body = {"input_ids": engine.tok.encode("hello"), "sampling": {"max_tokens": 1000}}
    with httpx.Client(timeout=10) as c, c.stream("POST", server.url + path, json=body,
                                                 headers=H) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data:")
            if got >= 5:
                break
    rid = engine.requests[-1].request_id
    assert _wait_for(lambda: rid in engine.aborted), "engine generator was not closed"
    assert rid not in engine.finished


def test_disconnect_non_streamed_aborts(server: Server, engine: FakeEngine) -> None:
    engine.script = lambda req: "word " * 400
    engine.per_event, engine.delay_s = 1, 0.02

    def call() -> None:
        try:
            httpx.post(server.url + "/v1/chat/completions", headers=H, timeout=0.5,
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        except httpx.TimeoutException:
            pass

    t = threading.Thread(target=call)
    t.start()
    t.join()
    assert _wait_for(lambda: engine.aborted
                     and engine.aborted[-1] == engine.requests[-1].request_id)
    # and the server keeps serving
    engine.reset()
    r = httpx.post(server.url + "/v1/chat/completions", headers=H,
                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200


def test_keepalive_comment_for_openai(server: Server, engine: FakeEngine,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_routes, "KEEPALIVE_S", 0.1)
    engine.first_delay_s = 0.35
    r = httpx.post(server.url + "/v1/chat/completions", headers=H,
                   json={"model": "m", "stream": True,
                         "messages": [{"role": "user", "content": "x"}]})
    names = [n for n, _ in parse_sse(r.text)]
    assert "#comment" in names and names[-1] is None


def test_anthropic_clamp_header(server: Server, engine: FakeEngine) -> None:
    r = httpx.post(server.url + "/v1/messages", headers=H, json={
        "model": "m", "max_tokens": 64000, "stream": True,
        "messages": [{"role": "user", "content": "x"}]})
    room = engine.max_context - len(engine.requests[-1].input_ids)
    assert r.headers["x-ft-max-tokens-clamped"] == str(room)
    assert r.headers["x-ft-max-tokens-requested"] == "64000"
    assert engine.requests[-1].sampling.max_tokens == room


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_unexpected_exception_is_a_shaped_500(server: Server, engine: FakeEngine, path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(req: object) -> None:
        raise RuntimeError("engine bug")

    monkeypatch.setattr(engine, "check", boom)
    r = httpx.post(server.url + path, headers=H, json={
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500
    j = r.json()
    if path == "/v1/messages":
        assert j["type"] == "error" and j["error"]["type"] == "api_error"
    else:
        assert j["error"]["type"] == "server_error" and "engine bug" in j["error"]["message"]
