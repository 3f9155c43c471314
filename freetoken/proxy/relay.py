"""One streamed response relayed from the upstream to the client.

A producer task reads the upstream body chunk by chunk, turns each chunk's complete SSE events
into client frames (unchanged when both sides speak the same API, translated otherwise) and puts
them on a small bounded queue; the response iterates the queue. So events leave as they arrive,
a slow client fills the queue and stops the upstream reads (backpressure: at most `QUEUE`
chunks in flight), and a client disconnect cancels the producer and closes the upstream
response, which cancels the upstream request. A timer (no task per event) puts a keep-alive on
the queue when it stayed empty for `ping_s`: an SSE comment before the first event, an
Anthropic `ping` event after it.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx

from freetoken.log import get_logger, kv
from freetoken.proxy.metrics import RequestRecord
from freetoken.proxy.probe import cached_from_openai, carries_token
from freetoken.proxy.translate import usage_from_anthropic, usage_from_openai
from freetoken.proxy.translate_stream import AnthropicToOpenAI, OpenAIToAnthropic, json_or_none
from freetoken.proxy.upstream import FINISH, SSEEvent, Upstream, error_from, sse_batches
from freetoken.server.errors import APIError, error_body
from freetoken.server.sse import sse, sse_comment

log = get_logger("proxy")
QUEUE = 4
_TICK, _END = object(), object()


class StreamRelay:
    def __init__(self, up: Upstream, pending: asyncio.Future, api_in: str, api_out: str,
                 model: str, rec: RequestRecord, cap: int | None, include_usage: bool,
                 on_done: Callable[[RequestRecord], None]) -> None:
        self.up, self.pending, self.api_in, self.api_out = up, pending, api_in, api_out
        self.rec, self.cap, self.on_done = rec, cap, on_done
        self.tr: Any = None
        if api_in == "anthropic" and api_out == "openai":
            self.tr = OpenAIToAnthropic("msg_" + rec.request_id, model)
        elif api_in == "openai" and api_out == "anthropic":
            self.tr = AnthropicToOpenAI("chatcmpl-" + rec.request_id, model, include_usage)
        self.started = False

    def _note(self, ev: SSEEvent) -> str | None:
        """Metrics from an upstream event; returns a rewritten data payload when the cap fired."""
        rec, data = self.rec, ev.data
        if rec.ttft_ms is None and carries_token(self.api_out, ev.event, data):
            rec.ttft_ms = round((time.time() - rec.t_start) * 1000, 2)  # to the first token
        if '"usage"' not in data and not FINISH.search(data):
            if self.api_out == "openai" and data != "[DONE]":
                rec.output_tokens += 1  # chunks, until the usage chunk gives the real count
            return None
        v = json_or_none(data)
        if not isinstance(v, dict):
            return None
        changed = False
        if self.api_out == "anthropic":
            u = v.get("usage") or (v.get("message") or {}).get("usage")
            if u:
                p, c, o = usage_from_anthropic(u)
                if ev.event == "message_start" or "input_tokens" in u:
                    rec.prompt_tokens, rec.cached_tokens = p, c
                rec.output_tokens = max(rec.output_tokens, o)
            d = v.get("delta") or {}
            if d.get("stop_reason"):
                rec.finish = d["stop_reason"]
                if rec.finish == "max_tokens" and self.cap is not None:
                    d["stop_reason"], changed, rec.capped = "end_turn", True, True
        else:
            if v.get("usage"):
                rec.prompt_tokens, _, rec.output_tokens = usage_from_openai(v["usage"])
                rec.cached_tokens = cached_from_openai(v)  # None: the upstream does not say
            for ch in v.get("choices") or []:
                if ch.get("finish_reason"):
                    rec.finish = ch["finish_reason"]
                    if rec.finish == "length" and self.cap is not None:
                        ch["finish_reason"], changed, rec.capped = "stop", True, True
        return json.dumps(v, ensure_ascii=False, separators=(",", ":")) if changed else None

    def _convert(self, batch: list[SSEEvent]) -> str:
        out: list[str] = []
        for ev in batch:
            new = self._note(ev)
            if self.tr is None:
                out.append(ev.raw if new is None else sse(new, ev.event))
                continue
            data = new if new is not None else ev.data
            parsed = data if data == "[DONE]" else json_or_none(data)
            out += (self.tr.push(parsed) if isinstance(self.tr, OpenAIToAnthropic)
                    else self.tr.push(ev.event, parsed))
        return "".join(out)

    async def _produce(self, q: asyncio.Queue) -> None:
        try:
            resp: httpx.Response = await self.pending
            if resp.status_code >= 400:
                raise error_from(resp.status_code, await resp.aread())
            async for batch in sse_batches(resp.aiter_text()):
                frames = self._convert(batch)
                if frames:
                    await q.put(frames)
            if self.tr is not None:
                await q.put("".join(self.tr.end()))
            await q.put(_END)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, answered in-band
            await q.put(e)

    def _error_frame(self, e: APIError) -> str:
        self.rec.status, self.rec.error = e.status, e.message
        return sse(error_body(self.api_in, e), "error" if self.api_in == "anthropic" else None)

    async def frames(self) -> AsyncIterator[str]:
        rec = self.rec
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue(QUEUE)
        producer = asyncio.ensure_future(self._produce(q))

        def tick() -> None:
            if q.empty():
                q.put_nowait(_TICK)

        try:
            while True:
                timer = loop.call_later(self.up.ping_s, tick)
                try:
                    item = await q.get()
                finally:
                    timer.cancel()
                if item is _TICK:
                    anth = self.api_in == "anthropic" and self.started
                    yield sse({"type": "ping"}, "ping") if anth else sse_comment("ping")
                elif item is _END:
                    return
                elif isinstance(item, APIError):
                    yield self._error_frame(item)
                    return
                elif isinstance(item, Exception):
                    log.info(kv("upstream_error", request=rec.request_id, error=repr(item)[:200]))
                    yield self._error_frame(APIError(502, f"upstream: {item!r}", None,
                                                     "upstream_error"))
                    return
                else:
                    self.started = True
                    yield item
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(producer)
            if rec.finish is None and rec.error is None:
                rec.disconnected = True
                log.info(kv("client_disconnect", request=rec.request_id, upstream="closed"))
            rec.duration_ms = round((time.time() - rec.t_start) * 1000, 2)
            self.on_done(rec)

    async def _close(self, producer: asyncio.Future) -> None:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        if not self.pending.done():  # still waiting for the upstream's headers
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)
        elif not self.pending.cancelled() and self.pending.exception() is None:
            await self.pending.result().aclose()
