"""`POST /v1/responses` (OpenAI Responses API) and `GET /v1/responses/{id}`, served by
translating to the host's own chat route (`call_chat`: `ft serve`'s `chat_completions`, or the
proxy's chat handling, which forwards to any engine) and the answer back
(`freetoken/chat/responses_map.py`, `responses_stream.py`).

State: a response created with `store` (default true, as in the API) is kept in a
`ResponseStore`: its full input items and its output items, so `previous_response_id` continues
from it (the stored items, then the new `input`). Bounded by count and by size; the least
recently used response is evicted first (one `responses_evict` line). An unknown or evicted
`previous_response_id` is a 400 `previous_response_not_found`. Codex sends `store: false` and
the whole history every turn, which renders to the same tokens (byte-stable mapping).

Session: `prompt_cache_key` (Codex: its session id) becomes the inner request's `x-session-id`,
so the engine and the proxy key the conversation by it.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.chat.errors import ChatInputError
from freetoken.chat.responses_map import ToolNames, input_items, new_id, to_chat, to_response
from freetoken.log import get_logger, kv
from freetoken.server.errors import APIError
from freetoken.server.guard import replaying
from freetoken.server.responses_stream import ResponsesEvents, chat_frames
from freetoken.server.sse import EventStreamResponse, sse_comment
from freetoken.server.validation import parse_json

log = get_logger("server")
ChatCall = Callable[[Request], Awaitable[Response]]


class ResponseStore:
    """Stored responses by id: (items of the whole conversation, the response object). LRU,
    at most `max_responses` and about `max_bytes` of JSON."""

    def __init__(self, max_responses: int = 256, max_bytes: int = 64 << 20) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._d: OrderedDict[str, tuple[list[Any], dict, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._d)

    def put(self, rid: str, items: list[Any], response: dict) -> None:
        size = len(json.dumps(items)) + len(json.dumps(response))
        if size > self.max_bytes:
            log.info(kv("responses_not_stored", response=rid, bytes=size, cap=self.max_bytes))
            return
        self._d[rid] = (items, response, size)
        self.bytes += size
        while len(self._d) > self.max_responses or self.bytes > self.max_bytes:
            old, (_, _, n) = self._d.popitem(last=False)
            self.bytes -= n
            log.info(kv("responses_evict", response=old, bytes=n, kept=len(self._d)))

    def get(self, rid: str) -> tuple[list[Any], dict] | None:
        hit = self._d.get(rid)
        if hit is None:
            return None
        self._d.move_to_end(rid)
        return hit[0], hit[1]


def _inner(request: Request, chat: dict, session: str | None) -> Request:
    """The same request as a chat completions call with body `chat`."""
    raw = json.dumps(chat, ensure_ascii=False).encode()
    scope = dict(request.scope)
    scope["path"] = scope["raw_path"] = "/v1/chat/completions"
    if isinstance(scope["raw_path"], str):
        scope["raw_path"] = scope["raw_path"].encode()
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length",)]
    headers.append((b"content-length", str(len(raw)).encode()))
    if session and not any(k == b"x-session-id" for k, _ in headers):
        headers.append((b"x-session-id", _header_value(session)))
    scope["headers"] = headers
    return Request(scope, replaying(raw, request.receive))


def _header_value(key: str) -> bytes:
    """`prompt_cache_key` as an `x-session-id` value that can be sent on (the proxy forwards
    it upstream): at most 256 bytes, else, or with a control character or edge whitespace
    (no HTTP header may carry those; httpx refused it, a 502), its digest."""
    raw = key.encode()
    if len(raw) <= 256 and raw == raw.strip() and not any(c < 0x20 or c == 0x7F for c in raw):
        return raw
    return b"pck-" + hashlib.sha256(raw).hexdigest()[:32].encode()


def _history(store: ResponseStore, body: dict) -> list[Any]:
    prev = body.get("previous_response_id")
    if prev is None:
        return []
    if not isinstance(prev, str):
        raise APIError.bad("previous_response_id must be a string", "previous_response_id")
    hit = store.get(prev)
    if hit is None:
        raise APIError.bad(f"previous response {prev!r} not found (never stored, or evicted)",
                           "previous_response_id", "previous_response_not_found")
    return list(hit[0])


def _passed_headers(resp: Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.startswith("x-ft-")}


async def create_response(request: Request, store: ResponseStore, call_chat: ChatCall
                          ) -> Response:
    # NaN / Infinity refused as JSON (the proxy's rule): the response echoes the request's
    # fields (tools, metadata, ...), and an out-of-range float there cannot be written back
    body = parse_json(await request.body(), constants=False)
    if "input" not in body:
        raise APIError.bad("input is required", "input")
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise APIError.bad("stream must be a boolean", "stream")
    try:
        items = _history(store, body) + input_items(body)
        chat, names = to_chat(body, items)
    except ChatInputError as e:
        raise APIError.bad(e.message, e.param) from None
    session = body.get("prompt_cache_key")
    resp = await call_chat(_inner(request, chat, session if isinstance(session, str) else None))
    if resp.status_code >= 400:
        return resp  # the chat route's error, already in the OpenAI shape
    rid = new_id("resp_")
    keep = body.get("store", True) is not False
    if not chat["stream"]:
        try:
            data = json.loads(bytes(resp.body))
        except ValueError:
            raise APIError(502, "the chat route answered non-JSON", None,
                           "upstream_error") from None
        if not data:  # the client left
            return Response(status_code=499)
        out = to_response(data, rid, body, names)
        if keep:
            store.put(rid, items + out["output"], out)
        log.info(kv("responses", response=rid, items=len(items), output=len(out["output"]),
                    stream=False, stored=keep))
        return JSONResponse(out, headers=_passed_headers(resp))
    return EventStreamResponse(_relay(resp, rid, body, names, items, store if keep else None),
                               _passed_headers(resp), rid)


async def _relay(resp: Response, rid: str, body: dict, names: ToolNames, items: list[Any],
                 store: ResponseStore | None) -> AsyncIterator[str]:
    it = resp.body_iterator  # type: ignore[attr-defined]
    ev = ResponsesEvents(rid, body, names)
    for f in ev.start():
        yield f
    buf = ""
    done = False
    try:
        async for chunk in it:
            buf += chunk.decode() if isinstance(chunk, bytes) else chunk
            if "\n\n" not in buf:
                continue
            complete, _, buf = buf.rpartition("\n\n")
            for kind, v in chat_frames(complete):
                if kind == "comment":
                    yield sse_comment()
                elif v == "[DONE]":
                    continue
                elif isinstance(v, dict) and isinstance(v.get("error"), dict):
                    for f in ev.failed(str(v["error"].get("message", "")),
                                       str(v["error"].get("code") or "server_error")):
                        yield f
                    done = True
                    return
                elif isinstance(v, dict):
                    for f in ev.feed(v):
                        yield f
        for f in ev.finish():
            yield f
        done = True
        if store is not None:
            r = ev.response()
            store.put(rid, items + r["output"], r)
        log.info(kv("responses", response=rid, items=len(items), output=len(ev.output),
                    stream=True, stored=store is not None))
    finally:
        if not done:
            log.info(kv("responses_stream_closed", response=rid))
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def get_response(request: Request, store: ResponseStore) -> Response:
    rid = request.path_params["response_id"]
    hit = store.get(rid)
    if hit is None:
        raise APIError(404, f"response {rid!r} not found (never stored, or evicted)", None,
                       "not_found")
    return JSONResponse(hit[1])
