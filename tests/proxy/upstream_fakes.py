"""Mocked upstreams (respx routers behind an injected httpx client) and a proxy app on a real
uvicorn server, for the API-mode tests."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import respx
from server_helpers import Server

from freetoken.proxy.app import create_proxy_app
from freetoken.proxy.config import ProxyConfig

UP = "http://upstream.test"


GATE_S = 20.0  # the longest an Events gate waits (then the test's assertions fail instead)


class Events(httpx.AsyncByteStream):
    """An upstream SSE body: `frames` sent one by one with `delay` between them (then, with
    `forever`, keep-alive frames until closed); records whether the proxy closed it."""

    def __init__(self, frames: list[str], delay: float = 0.0, first_delay: float = 0.0,
                 forever: bool = False, gate: Callable[[], bool] | None = None,
                 gate_after: int = 0) -> None:
        """`gate`: after `gate_after` frames, wait (up to GATE_S) until it returns True: a
        test's condition instead of a delay, so a loaded machine cannot outrun it."""
        self.frames, self.delay, self.first_delay = frames, delay, first_delay
        self.forever = forever
        self.gate, self.gate_after = gate, gate_after
        self.closed = False
        self.sent = 0

    async def _wait_gate(self) -> None:
        t0 = time.monotonic()
        while self.gate is not None and not self.gate() and time.monotonic() - t0 < GATE_S:
            await asyncio.sleep(0.005)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await asyncio.sleep(self.first_delay)
        for i, f in enumerate(self.frames):
            if i == self.gate_after:
                await self._wait_gate()
            self.sent += 1
            yield f.encode()
            await asyncio.sleep(self.delay)
        while self.forever and not self.closed:
            self.sent += 1
            yield b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        self.closed = True


def oa_chunk(delta: dict, finish: str | None = None) -> str:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
             "model": "up", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return "data: " + json.dumps(chunk) + "\n\n"


def oa_stream(finish: str = "tool_calls") -> list[str]:
    return [oa_chunk({"role": "assistant", "content": ""}),
            oa_chunk({"reasoning_content": "Let me "}), oa_chunk({"reasoning_content": "look."}),
            oa_chunk({"content": "Reading"}), oa_chunk({"content": " it."}),
            oa_chunk({"tool_calls": [{"index": 0, "id": "call_A", "type": "function",
                                      "function": {"name": "read", "arguments": ""}}]}),
            oa_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": '}}]}),
            oa_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"README.md"}'}}]}),
            oa_chunk({}, finish),
            "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                                   "created": 1, "model": "up", "choices": [], "usage": {
                                       "prompt_tokens": 120, "completion_tokens": 9,
                                       "total_tokens": 129,
                                       "prompt_tokens_details": {"cached_tokens": 100}}}) + "\n\n",
            "data: [DONE]\n\n"]


def an_ev(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def an_stream(stop: str = "tool_use") -> list[str]:
    usage = {"input_tokens": 20, "cache_read_input_tokens": 100,
             "cache_creation_input_tokens": 0, "output_tokens": 1}
    return [an_ev("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "up", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage}}),
        an_ev("ping", {"type": "ping"}),
        an_ev("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "thinking", "thinking": ""}}),
        an_ev("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "thinking_delta", "thinking": "Let me look."}}),
        an_ev("content_block_stop", {"type": "content_block_stop", "index": 0}),
        an_ev("content_block_start", {"type": "content_block_start", "index": 1,
                                      "content_block": {"type": "text", "text": ""}}),
        an_ev("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
            "type": "text_delta", "text": "Reading it."}}),
        an_ev("content_block_stop", {"type": "content_block_stop", "index": 1}),
        an_ev("content_block_start", {"type": "content_block_start", "index": 2,
                                      "content_block": {"type": "tool_use", "id": "toolu_A",
                                                        "name": "read", "input": {}}}),
        an_ev("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": '{"path": '}}),
        an_ev("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": '"README.md"}'}}),
        an_ev("content_block_stop", {"type": "content_block_stop", "index": 2}),
        an_ev("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 9}}),
        an_ev("message_stop", {"type": "message_stop"})]


@dataclass
class Proxy:
    server: Server
    router: respx.MockRouter
    app: object
    seen: list[httpx.Request] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    def last_json(self) -> dict:
        return json.loads(self.seen[-1].content)

    def stats(self) -> dict:
        return httpx.get(self.url + "/proxy/stats").json()


def start_proxy(cfg_kwargs: dict) -> Proxy:
    router = respx.MockRouter(assert_all_called=False, assert_all_mocked=True)
    client = httpx.AsyncClient(transport=httpx.MockTransport(router.async_handler),
                               timeout=httpx.Timeout(None, connect=5))
    cfg = ProxyConfig(upstream=UP, **cfg_kwargs)
    app = create_proxy_app(cfg, client=client)
    return Proxy(Server(app), router, app)
