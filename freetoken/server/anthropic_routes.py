"""Anthropic routes: /v1/messages (streamed and not; `?beta=true` accepted) and
/v1/messages/count_tokens.

Stream event order (what the real API sends and the SDKs check):
`message_start` → `ping` → per content block `content_block_start`, `content_block_delta`*
(`thinking_delta` then one `signature_delta` for thinking blocks, `text_delta`,
`input_json_delta` for tool_use), `content_block_stop` → `message_delta` (stop_reason,
stop_sequence, usage) → `message_stop`. `message_start` is sent when the engine has processed
the prompt, so its usage carries the real `cache_read_input_tokens`. A `ping` event goes out
every KEEPALIVE_S seconds without output, before `message_start` too (while the engine queues or
prefills): the SDKs skip `ping` wherever it falls, and unlike an SSE comment it is an event, so a
harness that watches for events (not bytes) sees the stream alive.

Usage follows Anthropic's convention: `input_tokens` are the prompt tokens *not* read from
cache, `cache_read_input_tokens` the reused ones (their sum is the prompt length).
Fields not acted on (`metadata`, `context_management`, `output_config`, `cache_control`,
`service_tier`, `container`, ...) are accepted and ignored; the ones the API types strictly
(`metadata` an object, `stop_sequences` an array, `thinking.budget_tokens` a positive integer)
are still refused when malformed.
"""
from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.chat import ChatRequest, ReasoningDelta, TextDelta, ToolCall
from freetoken.log import get_logger, kv
from freetoken.server.errors import APIError, error_body
from freetoken.server.generation import (
    Finished,
    Started,
    admit,
    drive,
    new_id,
    parent_key_from,
    plan,
    session_key_from,
)
from freetoken.server.sse import (
    KEEPALIVE_S,
    PING,
    TICK,
    EventStreamResponse,
    run_unless_disconnected,
    sse,
    with_ticks,
)
from freetoken.server.state import ServerState, chat_request
from freetoken.server.validation import common_params, opt_bool, read_json

log = get_logger("server")


def signature(thinking: str) -> str:
    """A stable stand-in for Anthropic's thinking signature (we never verify signatures)."""
    return base64.b64encode(b"ft1:" + hashlib.sha256(thinking.encode()).digest()).decode()


def tool_input(arguments: str) -> dict:
    """Tool-use `input` must be an object; a parser result that is not one is kept verbatim."""
    try:
        v = json.loads(arguments)
    except ValueError:
        v = None
    if isinstance(v, dict):
        return v
    log.warning(kv("tool_args_not_object", arguments=arguments[:200]))
    return {"_raw_arguments": arguments}


def _usage(f: Finished | Started, output_tokens: int) -> dict:
    return {"input_tokens": f.prompt_tokens - f.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": f.cached_tokens, "output_tokens": output_tokens}


def _stop(f: Finished, saw_tools: bool) -> str:
    return {"length": "max_tokens", "stop_sequence": "stop_sequence"}.get(
        f.reason, "tool_use" if saw_tools else "end_turn")


async def _prepare(st: ServerState, body: dict) -> tuple[ChatRequest, Any]:
    """Validate and map messages/tools/tool_choice (one pass), then render."""
    cr = chat_request("anthropic", body)
    return cr, await st.render(cr.template, cr.prompt_tools)


async def count_tokens(request: Request) -> Response:
    st: ServerState = request.app.state.ft
    body = await read_json(request)
    st.check_model(body)
    _, prompt = await _prepare(st, body)
    return JSONResponse({"input_tokens": len(prompt.input_ids)})


async def messages(request: Request) -> Response:
    st: ServerState = request.app.state.ft
    body = await read_json(request)
    model = st.check_model(body)
    if body.get("max_tokens") is None:
        raise APIError.bad("max_tokens: Field required", "max_tokens", "missing_field")
    params = common_params(body, ("max_tokens",), "stop_sequences")
    stream = opt_bool(body, "stream")
    cr, prompt = await _prepare(st, body)
    ti = cr.template
    rid = new_id("msg_")
    pl = plan(st.engine, prompt.input_ids, prompt.anchors, params, st.tokenizer.eos_token_ids,
              session_key_from(request.headers), rid,
              parent_key=parent_key_from(request.headers))
    log.info(kv("messages", request=rid, prompt=pl.prompt_len,
                max_tokens=pl.req.sampling.max_tokens, stream=stream, tools=len(ti.tools or []),
                thinking=ti.enable_thinking, choice=cr.tool_choice))
    parser = st.parser(ti.enable_thinking is not False, prompt, ti.tools, "toolu_")
    events = drive(await admit(st.engine, pl), pl, parser, params.stops, TextDelta, TextDelta)
    base = {"id": rid, "type": "message", "role": "assistant", "model": model}
    if stream:
        return EventStreamResponse(_stream(events, base), pl.headers, rid)
    done, resp = await run_unless_disconnected(request.receive, _collect(events, base))
    return JSONResponse(resp if done else {}, headers=pl.headers)


async def _collect(events: AsyncIterator[Any], base: dict) -> dict:
    blocks: list[dict] = []
    fin: Finished | None = None
    saw_tools = False
    async for ev in events:
        if isinstance(ev, ReasoningDelta) and ev.text:
            if not blocks or blocks[-1]["type"] != "thinking":
                blocks.append({"type": "thinking", "thinking": ""})
            blocks[-1]["thinking"] += ev.text
        elif isinstance(ev, TextDelta) and ev.text:
            if not blocks or blocks[-1]["type"] != "text":
                blocks.append({"type": "text", "text": ""})
            blocks[-1]["text"] += ev.text
        elif isinstance(ev, ToolCall):
            saw_tools = True
            blocks.append({"type": "tool_use", "id": ev.id, "name": ev.name,
                           "input": tool_input(ev.arguments)})
        elif isinstance(ev, Finished):
            fin = ev
    assert fin is not None
    for b in blocks:
        if b["type"] == "thinking":
            b["signature"] = signature(b["thinking"])
    return {**base, "content": blocks, "stop_reason": _stop(fin, saw_tools),
            "stop_sequence": fin.stop_sequence, "usage": _usage(fin, fin.output_tokens)}


class _Blocks:
    """Open/close bookkeeping of content blocks in a stream."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.thinking: list[str] = []

    def open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        self.thinking = []
        return out + [sse({"type": "content_block_start", "index": self.index,
                           "content_block": block}, "content_block_start")]

    def delta(self, delta: dict) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                   "content_block_delta")

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(self.delta({"type": "signature_delta",
                                   "signature": signature("".join(self.thinking))}))
        self.kind = None
        return out + [sse({"type": "content_block_stop", "index": self.index},
                          "content_block_stop")]


async def _stream(events: AsyncIterator[Any], base: dict) -> AsyncIterator[str]:
    b = _Blocks()
    saw_tools = False
    try:
        async for ev in with_ticks(events, KEEPALIVE_S):
            if ev is TICK:
                yield PING
            elif isinstance(ev, Started):
                msg = {**base, "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": _usage(ev, 0)}
                yield sse({"type": "message_start", "message": msg}, "message_start")
                yield PING
            elif isinstance(ev, ReasoningDelta) and ev.text:
                if b.kind != "thinking":
                    for s in b.open("thinking", {"type": "thinking", "thinking": "",
                                                 "signature": ""}):
                        yield s
                b.thinking.append(ev.text)
                yield b.delta({"type": "thinking_delta", "thinking": ev.text})
            elif isinstance(ev, TextDelta) and ev.text:
                if b.kind != "text":
                    for s in b.open("text", {"type": "text", "text": ""}):
                        yield s
                yield b.delta({"type": "text_delta", "text": ev.text})
            elif isinstance(ev, ToolCall):
                saw_tools = True
                for s in b.open("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name,
                                             "input": {}}):
                    yield s
                args = json.dumps(tool_input(ev.arguments), ensure_ascii=False)
                yield b.delta({"type": "input_json_delta", "partial_json": args})
                for s in b.close():
                    yield s
            elif isinstance(ev, Finished):
                for s in b.close():
                    yield s
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": _stop(ev, saw_tools),
                                     "stop_sequence": ev.stop_sequence},
                           "usage": _usage(ev, ev.output_tokens)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except APIError as e:
        yield sse(error_body("anthropic", e), "error")
    except Exception as e:  # a bug: logged with traceback, reported in-band
        log.exception(kv("stream_error", request=base["id"]))
        yield sse(error_body("anthropic", APIError(500, f"internal error: {e!r}")), "error")
