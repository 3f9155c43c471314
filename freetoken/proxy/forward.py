"""API mode: send a normalised request to the upstream, streamed or not, and answer the client
in its own API shape (see upstream.py for the streaming contract)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.log import get_logger, kv
from freetoken.proxy.metrics import RequestRecord
from freetoken.proxy.probe import cached_from_openai
from freetoken.proxy.relay import StreamRelay, close_opened, unreachable, upstream_timeout
from freetoken.proxy.translate import (
    TranslationError,
    anthropic_to_openai_request,
    anthropic_to_openai_response,
    openai_to_anthropic_request,
    openai_to_anthropic_response,
    usage_from_anthropic,
    usage_from_openai,
)
from freetoken.proxy.upstream import Upstream, error_from
from freetoken.server.errors import APIError
from freetoken.server.scoped import ScopedTask, unless_disconnected
from freetoken.server.sse import EventStreamResponse

log = get_logger("proxy")


def translate_request(body: dict, api_in: str, api_out: str) -> dict:
    if api_in == api_out:
        return body
    try:
        if api_in == "anthropic":
            return anthropic_to_openai_request(body)
        return openai_to_anthropic_request(body)
    except TranslationError as e:
        raise APIError.bad(e.message, e.param) from None


def _cap_rewrite(resp: dict, api_out: str, rec: RequestRecord) -> None:
    if api_out == "anthropic":
        rec.finish = resp.get("stop_reason")
        if rec.finish == "max_tokens":
            resp["stop_reason"], rec.capped = "end_turn", True
    else:
        for ch in resp.get("choices") or []:
            rec.finish = ch.get("finish_reason")
            if rec.finish == "length":
                ch["finish_reason"], rec.capped = "stop", True


async def forward(up: Upstream, request: Request, body: dict, api_in: str, rec: RequestRecord,
                  model: str, cap: int | None, headers: dict[str, str],
                  on_done: Callable[[RequestRecord], None], raw: bytes | None = None
                  ) -> Response:
    """`body` is normalised and in the client's API; returns the client's response. A stream
    hands `rec` to `on_done` when it ends; otherwise the caller records it. `raw`: the body's
    bytes as received, sent as they are when nothing changed it (same API, no step fired)."""
    api_out = up.api_out(api_in)
    rec.api_out = api_out
    out = translate_request(body, api_in, api_out)
    forced_usage = False
    so = out.get("stream_options") if isinstance(out.get("stream_options"), dict) else {}
    if api_out == "openai" and out.get("stream") and not so.get("include_usage"):
        # asked for the metrics; StreamRelay takes it out again for a client that did not ask
        out["stream_options"] = {**so, "include_usage": True}
        raw, forced_usage = None, True
    if api_in != api_out:
        raw = None
    up_headers = up.headers(request.headers, api_out)
    url = up.url(api_out)
    if rec.stream:
        pending = ScopedTask(up.open(url, out, up_headers, raw))
        try:
            done, _ = await asyncio.wait({pending.task}, timeout=min(up.ping_s, up.first_byte_s))
            if done and not pending.task.exception():
                resp: httpx.Response = pending.task.result()
                if resp.status_code >= 400:  # refused at once: pass the status on, in our shape
                    raw = await resp.aread()
                    await resp.aclose()
                    raise error_from(resp.status_code, raw)
            elif done:
                raise unreachable(pending.task.exception())
        except BaseException:  # (cancelled included) until the relay owns the upstream request
            with anyio.CancelScope(shield=True):
                await close_opened(pending)
            raise
        so = body.get("stream_options") if api_in == "openai" else None  # not Anthropic's
        include_usage = isinstance(so, dict) and so.get("include_usage") is True
        relay = StreamRelay(up, pending, api_in, api_out, model, rec,
                            cap, include_usage, on_done, strip_usage=forced_usage)
        return EventStreamResponse(relay.frames(), headers, rec.request_id)

    async def call() -> httpx.Response:
        r = await up.open(url, out, up_headers, raw)
        try:
            await r.aread()
        finally:
            await r.aclose()
        return r

    try:
        with anyio.fail_after(up.total_s):
            finished, r = await unless_disconnected(request.receive, call())
    except TimeoutError:
        raise upstream_timeout("did not answer", up.total_s) from None
    except httpx.HTTPError as e:
        raise unreachable(e) from None
    if not finished:
        rec.disconnected = True
        return Response(status_code=499)
    rec.ttft_ms = round((time.time() - rec.t_start) * 1000, 2)
    if r.status_code >= 400:
        raise error_from(r.status_code, r.content)
    try:
        data: Any = r.json()
    except ValueError:
        raise APIError(502, "upstream answered non-JSON", None, "upstream_error") from None
    if cap is not None:
        _cap_rewrite(data, api_out, rec)
    if api_out == "anthropic":
        rec.prompt_tokens, rec.cached_tokens, rec.output_tokens = usage_from_anthropic(
            data.get("usage"))
    else:
        rec.prompt_tokens, _, rec.output_tokens = usage_from_openai(data.get("usage"))
        rec.cached_tokens = cached_from_openai(data)  # None: the upstream does not say
    if log.isEnabledFor(logging.DEBUG):  # kv() formats eagerly: keep it off the hot path
        log.debug(kv("forwarded", request=rec.request_id, status=r.status_code, api_out=api_out))
    if api_in == api_out and not rec.capped:  # as received: no re-encoding
        return Response(r.content, 200, headers=headers, media_type="application/json")
    if api_in != api_out:
        data = (openai_to_anthropic_response(data, model) if api_in == "anthropic"
                else anthropic_to_openai_response(data, model))
    return JSONResponse(data, headers=headers)
