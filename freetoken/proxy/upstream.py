"""Forwarding to another OpenAI- or Anthropic-compatible server (vLLM, SGLang, llama.cpp, another
`ft serve`): the normalised request goes out on the surface the upstream speaks, translated when
it is not the client's.

Streams pass through event by event as they arrive (nothing is buffered beyond one SSE event):
each client write is awaited before the next upstream read, so a slow client slows the
upstream read (backpressure), and a client that disconnects closes the upstream connection,
which cancels the upstream request. While the upstream is silent (queued, prefilling) the
client gets an SSE comment (before the first event) or an Anthropic `ping` event every
`ping_s` seconds. If the upstream answers an error before `ping_s`, its status is passed on with
the error in the client's API shape.

Auth: the client's `Authorization` / `x-api-key` go to the configured upstream only, or are
replaced by `--upstream-api-key`; they are never logged or recorded.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from freetoken.log import get_logger, kv
from freetoken.proxy.metrics import RequestRecord
from freetoken.proxy.translate import usage_from_anthropic, usage_from_openai
from freetoken.proxy.translate_stream import AnthropicToOpenAI, OpenAIToAnthropic, json_or_none
from freetoken.server.errors import APIError, error_body
from freetoken.server.sse import TICK, sse, sse_comment, with_ticks

log = get_logger("proxy")
_FINISH = re.compile(r'"(finish_reason|stop_reason)":\s*"')
_PASS_HEADERS = ("anthropic-version", "anthropic-beta", "user-agent", "x-session-id",
                 "x-session-affinity", "x-claude-code-session-id")


@dataclass
class SSEEvent:
    event: str | None
    data: str
    raw: str


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[SSEEvent]:
    """Group SSE lines into events; comments are dropped (we send our own keep-alives)."""
    event: str | None = None
    data: list[str] = []
    raw: list[str] = []
    async for line in lines:
        if line == "":
            if data:
                yield SSEEvent(event, "\n".join(data), "\n".join(raw) + "\n\n")
            event, data, raw = None, [], []
            continue
        if line.startswith(":"):
            continue
        raw.append(line)
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" ") if line[5:6] == " " else line[5:])
    if data:
        yield SSEEvent(event, "\n".join(data), "\n".join(raw) + "\n\n")


class Upstream:
    """`api`: 'openai', 'anthropic' or 'both' (what the upstream serves)."""

    def __init__(self, base_url: str, api: str, client: httpx.AsyncClient,
                 api_key: str | None = None, ping_s: float = 5.0) -> None:
        if api not in ("openai", "anthropic", "both"):
            raise ValueError(f"upstream api must be openai, anthropic or both, not {api!r}")
        self.base_url, self.api, self.client = base_url.rstrip("/"), api, client
        self.api_key, self.ping_s = api_key, ping_s

    def api_out(self, api_in: str) -> str:
        return api_in if self.api in ("both", api_in) else self.api

    def headers(self, incoming: Any, api_out: str) -> dict[str, str]:
        h = {k: v for k in _PASS_HEADERS if (v := incoming.get(k))}
        h["content-type"] = "application/json"
        key = self.api_key
        if key is None:
            auth = incoming.get("authorization") or ""
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else incoming.get("x-api-key")
        if key:
            if api_out == "anthropic":
                h["x-api-key"] = key
            else:
                h["authorization"] = f"Bearer {key}"
        if api_out == "anthropic":
            h.setdefault("anthropic-version", "2023-06-01")
        return h

    def url(self, api_out: str, count_tokens: bool = False) -> str:
        if api_out == "anthropic":
            return self.base_url + ("/v1/messages/count_tokens" if count_tokens else "/v1/messages")
        return self.base_url + "/v1/chat/completions"

    async def open(self, url: str, body: dict, headers: dict[str, str]) -> httpx.Response:
        req = self.client.build_request("POST", url, content=json.dumps(body).encode(),
                                        headers=headers)
        return await self.client.send(req, stream=True)


def error_from(status: int, raw: bytes) -> APIError:
    """An upstream error body (either shape) as an APIError with the upstream's status."""
    msg = raw.decode(errors="replace")[:1000]
    v = json_or_none(msg)
    if isinstance(v, dict) and isinstance(v.get("error"), dict):
        msg = str(v["error"].get("message") or msg)
    return APIError(status, f"upstream: {msg}", None, "upstream_error")


class StreamRelay:
    """One streamed response: upstream events -> client frames, with keep-alives, metrics and
    the output-cap rewrite. `first` is the already-open upstream response (or a pending task)."""

    def __init__(self, up: Upstream, pending: asyncio.Task, api_in: str, api_out: str,
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

    def _note(self, name: str | None, data: str) -> str | None:
        """Metrics from an upstream event; returns a rewritten data payload when the cap fired."""
        rec = self.rec
        if rec.ttft_ms is None and data != "[DONE]" and name not in ("message_start", "ping"):
            rec.ttft_ms = round((time.time() - rec.t_start) * 1000, 2)
        has_usage = '"usage"' in data
        if not has_usage and not _FINISH.search(data):
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
                if name == "message_start" or "input_tokens" in u:
                    rec.prompt_tokens, rec.cached_tokens = p, c
                rec.output_tokens = max(rec.output_tokens, o)
            d = v.get("delta") or {}
            if d.get("stop_reason"):
                rec.finish = d["stop_reason"]
                if rec.finish == "max_tokens" and self.cap is not None:
                    d["stop_reason"], changed, rec.capped = "end_turn", True, True
        else:
            if v.get("usage"):
                rec.prompt_tokens, rec.cached_tokens, rec.output_tokens = usage_from_openai(
                    v["usage"])
            for ch in v.get("choices") or []:
                if ch.get("finish_reason"):
                    rec.finish = ch["finish_reason"]
                    if rec.finish == "length" and self.cap is not None:
                        ch["finish_reason"], changed, rec.capped = "stop", True, True
        return json.dumps(v, ensure_ascii=False, separators=(",", ":")) if changed else None

    async def _frames(self) -> AsyncIterator[str]:
        resp: httpx.Response = await self.pending
        try:
            if resp.status_code >= 400:
                raise error_from(resp.status_code, await resp.aread())
            async for ev in sse_events(resp.aiter_lines()):
                new = self._note(ev.event, ev.data)
                data = new if new is not None else ev.data
                if self.tr is None:
                    self.started = True
                    yield ev.raw if new is None else sse(data, ev.event)
                    continue
                parsed = data if data == "[DONE]" else json_or_none(data)
                out = (self.tr.push(parsed) if isinstance(self.tr, OpenAIToAnthropic)
                       else self.tr.push(ev.event, parsed))
                for frame in out:
                    self.started = True
                    yield frame
            if self.tr is not None:
                for frame in self.tr.end():
                    yield frame
        finally:
            await resp.aclose()

    async def frames(self) -> AsyncIterator[str]:
        rec = self.rec
        try:
            async for item in with_ticks(self._frames(), self.up.ping_s):
                if item is TICK:
                    anth = self.api_in == "anthropic" and self.started
                    yield sse({"type": "ping"}, "ping") if anth else sse_comment("ping")
                else:
                    yield item
        except APIError as e:
            rec.status, rec.error = e.status, e.message
            yield sse(error_body(self.api_in, e), "error" if self.api_in == "anthropic" else None)
        except httpx.HTTPError as e:
            rec.status, rec.error = 502, f"upstream: {e!r}"
            log.info(kv("upstream_error", request=rec.request_id, error=repr(e)[:200]))
            yield sse(error_body(self.api_in, APIError(502, rec.error, None, "upstream_error")),
                      "error" if self.api_in == "anthropic" else None)
        finally:
            if not self.pending.done():  # still waiting for the upstream's headers
                self.pending.cancel()
            elif not self.pending.cancelled() and self.pending.exception() is None:
                with anyio.CancelScope(shield=True):
                    await self.pending.result().aclose()
            if rec.finish is None and rec.error is None:
                rec.disconnected = True
                log.info(kv("client_disconnect", request=rec.request_id, upstream="closed"))
            rec.duration_ms = round((time.time() - rec.t_start) * 1000, 2)
            self.on_done(rec)
