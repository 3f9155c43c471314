"""One streamed response relayed from the upstream to the client.

A producer task reads the upstream body chunk by chunk, turns each chunk's complete SSE events
into client frames (unchanged when both sides speak the same API, translated otherwise) and puts
them on a small bounded queue; the response iterates the queue. So events leave as they arrive,
a slow client fills the queue and stops the upstream reads (backpressure: at most `QUEUE`
chunks in flight), and a client disconnect cancels the producer and closes the upstream
response, which cancels the upstream request. A timer (no task per event) puts a keep-alive on
the queue when it stayed empty for `ping_s`: an Anthropic `ping` event (before `message_start`
too: the SDKs skip `ping` wherever it falls), an SSE comment for the other APIs.

Upstream failures are visible, in the client's API shape, as an in-band `error` event (OpenAI
clients then get `[DONE]`); the stream never ends as a clean end of turn after one:
- no response headers and first body bytes within `first_byte_s`, nothing for `idle_s` between
  two chunks (keep-alive comments count: a live upstream that is still thinking is not idle),
  or more than `total_s` in all: 504 `upstream_timeout`;
- an answer that is not an event stream, an event whose data is not JSON (or `[DONE]`), or a
  body that ends before the reply did (no finish reason / `message_stop`, no `[DONE]`): 502
  `upstream_protocol` / `upstream_truncated`.

When the proxy asked an OpenAI upstream for usage the client did not ask for
(`stream_options.include_usage`, for the metrics), the usage is taken out again: no `usage`
field in the chunks and no `choices: []` usage chunk, as the OpenAI stream contract says.
"""
from __future__ import annotations

import asyncio
import json
import re
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
from freetoken.server.scoped import ScopedTask
from freetoken.server.sse import PING, sse, sse_comment

log = get_logger("proxy")
QUEUE = 4
_TICK, _END = object(), object()
# `"usage": null` as a key of the chunk object (a quote inside a JSON string is escaped, so
# these cannot match string content)
_NULL_USAGE = (re.compile(r',\s*"usage"\s*:\s*null'), re.compile(r'"usage"\s*:\s*null\s*,?'))


def upstream_timeout(what: str, seconds: float) -> APIError:
    return APIError(504, f"the upstream {what} within {seconds:g} s", None, "upstream_timeout")


def unreachable(e: BaseException | None) -> APIError:
    """An upstream transport failure: 504 for a timeout (connect included), 502 otherwise."""
    if isinstance(e, httpx.TimeoutException):
        return APIError(504, f"upstream timed out: {e!r}", None, "upstream_timeout")
    return APIError(502, f"upstream unreachable: {e!r}", None, "upstream_error")


def _protocol(msg: str, code: str = "upstream_protocol") -> APIError:
    return APIError(502, f"upstream: {msg}", None, code)


class StreamRelay:
    def __init__(self, up: Upstream, pending: ScopedTask[httpx.Response], api_in: str,
                 api_out: str,
                 model: str, rec: RequestRecord, cap: int | None, include_usage: bool,
                 on_done: Callable[[RequestRecord], None], strip_usage: bool = False) -> None:
        self.up, self.pending, self.api_in, self.api_out = up, pending, api_in, api_out
        self.rec, self.cap, self.on_done = rec, cap, on_done
        self.strip_usage = strip_usage and api_in == api_out == "openai"
        self.tr: Any = None
        if api_in == "anthropic" and api_out == "openai":
            self.tr = OpenAIToAnthropic("msg_" + rec.request_id, model)
        elif api_in == "openai" and api_out == "anthropic":
            self.tr = AnthropicToOpenAI("chatcmpl-" + rec.request_id, model, include_usage)
        self.finished = False  # the upstream's reply reached its end (or its own error event)

    def _note(self, ev: SSEEvent) -> str | None:
        """Metrics from an upstream event, and whether the reply ended; returns a rewritten
        data payload when the cap fired or usage is stripped."""
        rec, data = self.rec, ev.data
        if data == "[DONE]" or ev.event in ("message_stop", "error"):
            self.finished = True
        elif not (data.startswith("{") and data.rstrip().endswith("}")):
            raise _protocol(f"malformed event data {data[:200]!r}")
        if rec.ttft_ms is None and carries_token(self.api_out, ev.event, data):
            rec.ttft_ms = round((time.time() - rec.t_start) * 1000, 2)  # to the first token
        if '"usage"' not in data and not FINISH.search(data) and '"error"' not in data:
            if self.api_out == "openai" and data != "[DONE]":
                rec.output_tokens += 1  # chunks, until the usage chunk gives the real count
            return None
        v = json_or_none(data)
        if not isinstance(v, dict):
            raise _protocol(f"malformed event data {data[:200]!r}")
        if "error" in v or v.get("type") in ("error", "message_stop"):
            self.finished = True
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
                self.finished = True
                if rec.finish == "max_tokens" and self.cap is not None:
                    d["stop_reason"], changed, rec.capped = "end_turn", True, True
        else:
            if v.get("usage"):
                rec.prompt_tokens, _, rec.output_tokens = usage_from_openai(v["usage"])
                rec.cached_tokens = cached_from_openai(v)  # None: the upstream does not say
            for ch in v.get("choices") or []:
                if ch.get("finish_reason"):
                    rec.finish = ch["finish_reason"]
                    self.finished = True
                    if rec.finish == "length" and self.cap is not None:
                        ch["finish_reason"], changed, rec.capped = "stop", True, True
            if self.strip_usage and "usage" in v:
                if not v.get("choices"):
                    return ""  # the usage chunk the client did not ask for: dropped
                del v["usage"]
                changed = True
        return json.dumps(v, ensure_ascii=False, separators=(",", ":")) if changed else None

    def _strip_null_usage(self, data: str) -> str:
        for pat in _NULL_USAGE:
            data, n = pat.subn("", data, count=1)
            if n:
                break
        return data

    def _convert(self, batch: list[SSEEvent]) -> str:
        out: list[str] = []
        for ev in batch:
            if self.strip_usage and '"usage"' in ev.data:
                stripped = self._strip_null_usage(ev.data)
                if stripped != ev.data:
                    ev = SSEEvent(ev.event, stripped, sse(stripped, ev.event))
            new = self._note(ev)
            if new == "":
                continue
            if self.tr is None:
                out.append(ev.raw if new is None else sse(new, ev.event))
                continue
            data = new if new is not None else ev.data
            parsed = data if data == "[DONE]" else json_or_none(data)
            out += (self.tr.push(parsed) if isinstance(self.tr, OpenAIToAnthropic)
                    else self.tr.push(ev.event, parsed))
        return "".join(out)

    async def _response(self, deadline: float) -> httpx.Response:
        """The upstream's response head, within the first-byte and total timeouts."""
        up = self.up
        try:
            with anyio.fail_after(max(0.0, min(up.first_byte_s, deadline - time.monotonic()))):
                return await self.pending.result()  # (waits: a timeout stops it in _close)
        except TimeoutError:
            raise upstream_timeout("sent no response", up.first_byte_s) from None

    async def _chunks(self, resp: httpx.Response, deadline: float) -> AsyncIterator[str]:
        """The body's text chunks: the first within `first_byte_s` of the request, each next
        within `idle_s` of the one before, all within `total_s`."""
        up = self.up
        it = resp.aiter_text().__aiter__()
        first = True
        while True:
            if first:
                budget = up.first_byte_s - (time.monotonic() - self.t0)
                err = upstream_timeout("sent no event", up.first_byte_s)
            else:
                budget, err = up.idle_s, upstream_timeout("sent nothing more", up.idle_s)
            left = deadline - time.monotonic()
            if left < budget:
                budget, err = left, upstream_timeout("did not finish its reply", up.total_s)
            try:
                with anyio.fail_after(max(0.0, budget)):
                    chunk = await it.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise err from None
            yield chunk
            first = False

    async def _produce(self, q: asyncio.Queue) -> None:
        try:
            deadline = self.t0 + self.up.total_s
            resp = await self._response(deadline)
            if resp.status_code >= 400:
                raise error_from(resp.status_code, await resp.aread())
            ctype = resp.headers.get("content-type", "")
            if "text/event-stream" not in ctype.lower():
                head = (await resp.aread())[:200]
                raise _protocol(f"a stream was asked for but the answer is {ctype or 'untyped'!r}"
                                f", not an event stream: {head!r}")
            async for batch in sse_batches(self._chunks(resp, deadline)):
                frames = self._convert(batch)
                if frames:
                    await q.put(frames)
            complete = self.finished or (self.tr is not None and self.tr.complete)
            if not complete:
                raise _protocol("the stream ended before the reply did (no finish reason, no "
                                "end event): the reply is incomplete", "upstream_truncated")
            if self.tr is not None:
                tail = "".join(self.tr.end())  # nothing when the upstream's end already went
                if tail:
                    await q.put(tail)
            await q.put(_END)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, answered in-band
            await q.put(e)

    def _error_frame(self, e: APIError) -> str:
        self.rec.status, self.rec.error = e.status, e.message
        if self.api_in == "anthropic":
            return sse(error_body("anthropic", e), "error")
        return sse(error_body("openai", e)) + "data: [DONE]\n\n"

    async def frames(self) -> AsyncIterator[str]:
        rec = self.rec
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue(QUEUE)
        self.t0 = time.monotonic() - (time.time() - rec.t_start)
        producer = ScopedTask(self._produce(q))

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
                    yield PING if self.api_in == "anthropic" else sse_comment("ping")
                elif item is _END:
                    return
                elif isinstance(item, APIError):
                    log.info(kv("upstream_error", request=rec.request_id, status=item.status,
                                code=item.code, error=item.message[:200]))
                    yield self._error_frame(item)
                    return
                elif isinstance(item, httpx.HTTPError):  # (a connect timeout: 504)
                    err = unreachable(item)
                    log.info(kv("upstream_error", request=rec.request_id, status=err.status,
                                code=err.code, error=repr(item)[:200]))
                    yield self._error_frame(err)
                    return
                elif isinstance(item, Exception):
                    log.info(kv("upstream_error", request=rec.request_id, error=repr(item)[:200]))
                    yield self._error_frame(APIError(502, f"upstream: {item!r}", None,
                                                     "upstream_error"))
                    return
                else:
                    yield item
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(producer)
            if rec.finish is None and rec.error is None:
                rec.disconnected = True
                log.info(kv("client_disconnect", request=rec.request_id, upstream="closed"))
            rec.duration_ms = round((time.time() - rec.t_start) * 1000, 2)
            self.on_done(rec)

    async def _close(self, producer: ScopedTask[None]) -> None:
        await producer.stop()  # (through cancel scopes: server/scoped.py says why)
        await close_opened(self.pending)


async def close_opened(pending: ScopedTask[httpx.Response]) -> None:
    """Stop an upstream request (still waiting for its headers, or done) and close its
    response if it got one: its pooled connection is released either way."""
    await pending.stop()
    t = pending.task
    if not t.cancelled() and t.exception() is None:
        await t.result().aclose()
