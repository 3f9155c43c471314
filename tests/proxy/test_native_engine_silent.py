"""`ft agent-proxy --native-url` (and the in-process engine) in front of an engine that stops
answering: its stream carries a keep-alive every 5 s while it works, so a stream silent for the
idle timeout is a stopped or unreachable engine, and the client gets an error in its API's shape
(504 `upstream_timeout`) instead of pings for ever (issue 22 item 4, the native path). Control:
an engine slower than the timeout that keeps sending keep-alives is waited for."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_helpers import Server
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
from freetoken.proxy.app import create_proxy_app
from freetoken.proxy.config import ProxyConfig

IDLE = 1.0


def _engine(silent: bool) -> Server:
    async def health(request):
        return JSONResponse({"status": "ok", "model": "fake", "max_context": 4096})

    async def generate(request):
        body = await request.json()

        async def events():
            yield ": keep-alive\n\n"
            if silent:
                await asyncio.sleep(60)  # stopped: not even keep-alives
            for _ in range(int(3 * IDLE / 0.3)):  # slow, but alive
                await asyncio.sleep(0.3)
                yield ": keep-alive\n\n"
            yield "data: " + json.dumps({"token_ids": [9707], "finished": True,
                                         "finish_reason": "stop",
                                         "prompt_tokens": len(body["input_ids"]),
                                         "cached_tokens": 0}) + "\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Server(Starlette(routes=[Route("/health", health),
                                    Route("/ft/v1/generate", generate, methods=["POST"])]))


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen3_tokenizer_dir())


def _proxy(engine: Server, tok: ChatTokenizer, tmp_path) -> Server:
    cfg = ProxyConfig(native_url=engine.url, caps={"*": 16}, idle_timeout_s=IDLE,
                      metrics_path=str(tmp_path / "m.jsonl"))
    return Server(create_proxy_app(cfg, tok, "qwen3"))


MSG = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def test_a_silent_engine_is_an_error_in_the_clients_shape(tok, tmp_path) -> None:
    eng = _engine(silent=True)
    proxy = _proxy(eng, tok, tmp_path)
    try:
        t0 = time.perf_counter()
        r = httpx.post(proxy.url + "/v1/messages", json=MSG, timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["type"] == "error" and "sent nothing" in r.json()["error"]["message"]
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=30,
                          json={**MSG, "stream": True}) as s:
            text = "".join(s.iter_text())
        assert '"upstream_timeout"' in text or "sent nothing" in text, text[-500:]
        assert time.perf_counter() - t0 < 6 * IDLE + 5
    finally:
        proxy.stop()
        eng.stop()


def test_a_slow_engine_that_keeps_sending_keep_alives_is_waited_for(tok, tmp_path) -> None:
    eng = _engine(silent=False)
    proxy = _proxy(eng, tok, tmp_path)
    try:
        r = httpx.post(proxy.url + "/v1/messages", json=MSG, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["stop_reason"] == "end_turn"
    finally:
        proxy.stop()
        eng.stop()
