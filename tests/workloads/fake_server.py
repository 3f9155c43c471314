"""A small in-process OpenAI + Anthropic streaming server for the workload runner tests.

It is the oracle for the runner: it emits exactly `max_tokens` tokens when `ignore_eos` is set
(else a natural 5, raised to `min_tokens`), and reports as cached the longest common prefix (in
regex tokens of the canonical request, `cache_control` ignored) with any earlier request, the way
a prefix cache would.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

PREFILL_S = 0.02
PER_TOKEN_S = 0.004
_TOKEN = re.compile(r"\w+|[^\w\s]")


def strip_cache_control(x: Any) -> Any:
    """x without `cache_control` keys at any depth (cache hints do not change a prompt)."""
    if isinstance(x, dict):
        return {k: strip_cache_control(v) for k, v in x.items() if k != "cache_control"}
    if isinstance(x, list):
        return [strip_cache_control(v) for v in x]
    return x


def prompt_tokens(body: dict[str, Any]) -> list[str]:
    canon = {k: strip_cache_control(body[k]) for k in ("system", "tools", "messages") if k in body}
    return _TOKEN.findall(json.dumps(canon, ensure_ascii=False))


def _lcp(a: list[str], b: list[str]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class FakeServer:
    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self.log: list[dict[str, Any]] = []
        self.usage = True
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.openai, methods=["POST"]),
                                     Route("/v1/messages", self.anthropic, methods=["POST"])])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> FakeServer:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)

    def _admit(self, body: dict[str, Any], path: str) -> tuple[int, int, int]:
        toks = prompt_tokens(body)
        cached = max((_lcp(toks, p) for p in self.seen), default=0)
        self.seen.append(toks)
        cap = body.get("max_completion_tokens") or body["max_tokens"]
        n = cap if body.get("ignore_eos") else min(5, cap)
        n = min(cap, max(n, body.get("min_tokens", 0)))
        self.log.append({"path": path, "body": body, "t_start": time.perf_counter(),
                         "prompt": len(toks), "cached": cached, "n": n})
        return len(toks), cached, n

    async def openai(self, req: Request) -> StreamingResponse:
        body = await req.json()
        prompt, cached, n = self._admit(body, "openai")
        entry = self.log[-1]

        async def gen() -> Any:
            await asyncio.sleep(PREFILL_S)
            for i in range(n):
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {
                    "content": f"t{i} "}}]}) + "\n\n"
                await asyncio.sleep(PER_TOKEN_S)
            if self.usage:
                yield "data: " + json.dumps({"choices": [], "usage": {
                    "prompt_tokens": prompt, "completion_tokens": n,
                    "prompt_tokens_details": {"cached_tokens": cached}}}) + "\n\n"
            yield "data: [DONE]\n\n"
            entry["t_end"] = time.perf_counter()
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def anthropic(self, req: Request) -> StreamingResponse:
        body = await req.json()
        prompt, cached, n = self._admit(body, "anthropic")
        entry = self.log[-1]

        def ev(kind: str, data: dict[str, Any]) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        async def gen() -> Any:
            await asyncio.sleep(PREFILL_S)
            yield ev("message_start", {"message": {"id": "msg_1", "role": "assistant", "usage": {
                "input_tokens": prompt - cached, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": 1}}})
            yield ev("content_block_start", {"index": 0, "content_block": {"type": "text",
                                                                           "text": ""}})
            for i in range(n):
                yield ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                       "text": f"t{i} "}})
                await asyncio.sleep(PER_TOKEN_S)
            yield ev("content_block_stop", {"index": 0})
            yield ev("message_delta", {"delta": {"stop_reason": "max_tokens"},
                                       "usage": {"output_tokens": n}})
            yield ev("message_stop", {})
            entry["t_end"] = time.perf_counter()
        return StreamingResponse(gen(), media_type="text/event-stream")
