"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

Chat: reasoning goes to `reasoning_content` (message field, and the stream delta field), tool
calls to `tool_calls` (each call streamed whole in one delta). finish_reason is 'tool_calls'
when the model ended its turn after calling tools, 'stop' at end of turn or a stop string,
'length' at max_tokens. Extensions: `top_k`, `min_tokens`, `ignore_eos`; `max_tokens` is a
ceiling clamped to the context room (header `x-ft-max-tokens-clamped`). Only `n` = 1.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.chat import (
    IncrementalDetokenizer,
    ReasoningDelta,
    TextDelta,
    ToolCall,
)
from freetoken.log import get_logger, kv
from freetoken.server.errors import APIError, error_body
from freetoken.server.generation import (
    Finished,
    admit,
    drive,
    new_id,
    parent_key_from,
    plan,
    session_key_from,
)
from freetoken.server.sse import (
    KEEPALIVE_S,
    TICK,
    EventStreamResponse,
    run_unless_disconnected,
    sse,
    sse_comment,
    with_ticks,
)
from freetoken.server.state import ServerState, chat_request
from freetoken.server.validation import common_params, opt_bool, opt_dict, opt_int, read_json

log = get_logger("server")
DONE = "data: [DONE]\n\n"


def _usage(f: Finished) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.output_tokens,
            "total_tokens": f.prompt_tokens + f.output_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}


def _finish_reason(f: Finished, saw_tools: bool) -> str:
    if f.reason == "length":
        return "length"
    return "tool_calls" if saw_tools and f.reason == "stop" else "stop"


def _tool_call(ev: ToolCall) -> dict:
    return {"index": ev.index, "id": ev.id, "type": "function",
            "function": {"name": ev.name, "arguments": ev.arguments}}


def _only_n1(body: dict) -> None:
    n = opt_int(body, "n", lo=1)
    if n not in (None, 1):
        raise APIError.bad("only n=1 is supported", "n")


def _no_logprobs(wanted: bool) -> None:
    if wanted:
        raise APIError.bad("logprobs are not supported by this server", "logprobs")


def _stream_opts(body: dict) -> tuple[bool, bool]:
    stream = opt_bool(body, "stream")
    so = opt_dict(body, "stream_options")
    return stream, bool(so and opt_bool(so, "include_usage"))


async def chat_completions(request: Request) -> Response:
    st: ServerState = request.app.state.ft
    body = await read_json(request)
    model = st.check_model(body)
    cr = chat_request("openai", body)
    ti = cr.template
    _only_n1(body)
    _no_logprobs(opt_bool(body, "logprobs") or bool(opt_int(body, "top_logprobs", lo=0, hi=20)))
    rf = opt_dict(body, "response_format")
    if rf is not None and rf.get("type") not in (None, "text"):
        raise APIError.bad("response_format other than 'text' is not supported (no constrained "
                           "decoding)", "response_format")
    stream, include_usage = _stream_opts(body)
    params = common_params(body, ("max_completion_tokens", "max_tokens"), "stop")
    prompt = await st.render(ti, cr.prompt_tools)
    rid = new_id("chatcmpl-")
    pl = plan(st.engine, prompt.input_ids, prompt.anchors, params, st.tokenizer.eos_token_ids,
              session_key_from(request.headers), rid,
              parent_key=parent_key_from(request.headers))
    log.info(kv("chat", request=rid, prompt=pl.prompt_len, max_tokens=pl.req.sampling.max_tokens,
                stream=stream, tools=len(ti.tools or []), choice=cr.tool_choice))
    parser = st.parser(ti.enable_thinking is not False, prompt, ti.tools, "call_")
    events = drive(await admit(st.engine, pl), pl, parser, params.stops, TextDelta, TextDelta)
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}
    if stream:
        return EventStreamResponse(_chat_stream(events, base, include_usage), pl.headers, rid)
    done, resp = await run_unless_disconnected(request.receive, _chat_collect(events, base))
    return JSONResponse(resp if done else {}, headers=pl.headers)


async def _chat_collect(events: AsyncIterator[Any], base: dict) -> dict:
    reasoning, text, calls = [], [], []
    fin: Finished | None = None
    async for ev in events:
        if isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, ToolCall):
            calls.append(_tool_call(ev))
        elif isinstance(ev, Finished):
            fin = ev
    assert fin is not None
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls
                           else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "message": msg, "logprobs": None,
                         "finish_reason": _finish_reason(fin, bool(calls))}],
            "usage": _usage(fin)}


async def _chat_stream(events: AsyncIterator[Any], base: dict, include_usage: bool
                       ) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: str | None = None) -> str:
        d = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}]}
        return sse({**d, "usage": None} if include_usage else d)

    saw_tools = False
    yield chunk({"role": "assistant", "content": ""})
    try:
        async for ev in with_ticks(events, KEEPALIVE_S):
            if ev is TICK:
                yield sse_comment()
            elif isinstance(ev, ReasoningDelta):
                yield chunk({"reasoning_content": ev.text})
            elif isinstance(ev, TextDelta):
                yield chunk({"content": ev.text})
            elif isinstance(ev, ToolCall):
                saw_tools = True
                yield chunk({"tool_calls": [_tool_call(ev)]})
            elif isinstance(ev, Finished):
                yield chunk({}, _finish_reason(ev, saw_tools))
                if include_usage:
                    yield sse({**base, "choices": [], "usage": _usage(ev)})
    except APIError as e:
        yield sse(error_body("openai", e))
    except Exception as e:  # a bug: logged with traceback, reported in-band
        log.exception(kv("stream_error", request=base["id"]))
        yield sse(error_body("openai", APIError(500, f"internal error: {e!r}", None,
                                                "internal_error")))
    yield DONE


class _TextParser:
    """Completions have no chat structure: every decoded piece is text."""

    def __init__(self, tok: Any) -> None:
        self.detok = IncrementalDetokenizer(tok)

    def push(self, ids: list[int]) -> list[Any]:
        s = self.detok.push(ids)
        return [TextDelta(s)] if s else []

    def finish(self) -> list[Any]:
        s = self.detok.flush()
        return [TextDelta(s)] if s else []


def _prompt_ids(st: ServerState, prompt: Any) -> list[int]:
    """`prompt`: a string, a list of token ids, or a batch of exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return st.tokenizer.encode(prompt)
    limit = st.vocab_limit()
    if (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in prompt)):
        return list(prompt)
    raise APIError.bad("'prompt' must be a non-empty string or a non-empty array of token ids "
                       f"in [0, {limit}) (batches of more than one prompt are not supported)",
                       "prompt")


async def completions(request: Request) -> Response:
    st: ServerState = request.app.state.ft
    body = await read_json(request)
    model = st.check_model(body)
    _only_n1(body)
    _no_logprobs(bool(opt_int(body, "logprobs", lo=0, hi=5)))
    if opt_bool(body, "echo"):
        raise APIError.bad("echo is not supported", "echo")
    ids = _prompt_ids(st, body.get("prompt"))
    stream, include_usage = _stream_opts(body)
    params = common_params(body, ("max_tokens",), "stop")
    if params.max_tokens is None:
        params.max_tokens = 16  # the OpenAI default for this legacy endpoint
    rid = new_id("cmpl-")
    pl = plan(st.engine, ids, [], params, st.tokenizer.eos_token_ids,
              session_key_from(request.headers), rid, "prompt",
              parent_key_from(request.headers))
    parser = _TextParser(st.tokenizer)
    events = drive(await admit(st.engine, pl), pl, parser, params.stops, TextDelta, TextDelta)
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    if stream:
        return EventStreamResponse(_completion_stream(events, base, include_usage), pl.headers,
                                   rid)
    done, resp = await run_unless_disconnected(request.receive, _completion_collect(events, base))
    return JSONResponse(resp if done else {}, headers=pl.headers)


async def _completion_collect(events: AsyncIterator[Any], base: dict) -> dict:
    parts, fin = [], None
    async for ev in events:
        if isinstance(ev, TextDelta):
            parts.append(ev.text)
        elif isinstance(ev, Finished):
            fin = ev
    assert fin is not None
    return {**base, "choices": [{"index": 0, "text": "".join(parts), "logprobs": None,
                                 "finish_reason": _finish_reason(fin, False)}],
            "usage": _usage(fin)}


async def _completion_stream(events: AsyncIterator[Any], base: dict, include_usage: bool
                             ) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        return sse({**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish}]})

    try:
        async for ev in with_ticks(events, KEEPALIVE_S):
            if ev is TICK:
                yield sse_comment()
            elif isinstance(ev, TextDelta):
                yield chunk(ev.text)
            elif isinstance(ev, Finished):
                yield chunk("", _finish_reason(ev, False))
                if include_usage:
                    yield sse({**base, "choices": [], "usage": _usage(ev)})
    except APIError as e:
        yield sse(error_body("openai", e))
    except Exception as e:
        log.exception(kv("stream_error", request=base["id"]))
        yield sse(error_body("openai", APIError(500, f"internal error: {e!r}", None,
                                                "internal_error")))
    yield DONE


async def models(request: Request) -> Response:
    """Served names in a shape both SDKs parse (OpenAI `object/created/owned_by`, Anthropic
    `type/display_name/created_at`), with the context length."""
    st: ServerState = request.app.state.ft
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.created))
    data = [{"id": n, "object": "model", "type": "model", "created": st.created,
             "created_at": created_at, "display_name": n, "owned_by": "freetoken",
             "context_length": st.engine.max_context, "max_model_len": st.engine.max_context}
            for n in st.served_model_names]
    return JSONResponse({"object": "list", "data": data, "has_more": False,
                         "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None})
