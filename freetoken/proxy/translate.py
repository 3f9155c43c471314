"""Anthropic <-> OpenAI translation of requests and of whole (non-streamed) responses.

Lossless where both APIs have the concept: text, tool calls (ids kept verbatim, so they stay
stable across turns), tool results, reasoning (`thinking` blocks <-> `reasoning_content`),
stop reasons, usage (Anthropic `input_tokens` excludes `cache_read_input_tokens`; OpenAI
`prompt_tokens` includes `prompt_tokens_details.cached_tokens`). Non-token fields of the other
API are dropped. Bad shapes raise `TranslationError`, answered 400 in the client's API shape.
"""
from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

from harness_adapters.base import text_of

STOP_TO_OPENAI = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                  "tool_use": "tool_calls", "pause_turn": "stop", "refusal": "content_filter"}
STOP_TO_ANTHROPIC = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                     "function_call": "tool_use", "content_filter": "refusal"}
DEFAULT_MAX_TOKENS = 4096  # Anthropic requires max_tokens; OpenAI clients may send none


class TranslationError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def signature(thinking: str) -> str:
    return base64.b64encode(b"ft1:" + hashlib.sha256(thinking.encode()).digest()).decode()


def _args_obj(arguments: Any, param: str) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        v = json.loads(arguments or "{}")
    except (TypeError, ValueError):
        raise TranslationError(f"{param} is not valid JSON", param) from None
    return v if isinstance(v, dict) else {"_raw_arguments": arguments}


# ---- requests ------------------------------------------------------------------------------

def _anth_user(content: Any, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict] = []
    texts: list[str] = []
    for j, b in enumerate(content if isinstance(content, list) else []):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                        "content": text_of(b.get("content")) if b.get("content") is not None
                        else ""})
        else:
            raise TranslationError(f"{param}[{j}]: block type {kind!r} cannot be translated",
                                   f"{param}[{j}].type")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _anth_assistant(content: Any) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    texts, thoughts, calls = [], [], []
    for b in content if isinstance(content, list) else []:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "thinking":
            thoughts.append(str(b.get("thinking", "")))
        elif kind == "tool_use":
            calls.append({"id": b.get("id"), "type": "function", "function": {
                "name": b.get("name"),
                "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
    msg["content"] = "\n".join(texts)
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def anthropic_to_openai_request(body: dict) -> dict:
    msgs: list[dict] = []
    if body.get("system") is not None:
        sys = text_of(body["system"])
        if sys:
            msgs.append({"role": "system", "content": sys})
    for i, m in enumerate(body.get("messages") or []):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            msgs.extend(_anth_user(m.get("content"), f"messages[{i}].content"))
        elif role == "assistant":
            msgs.append(_anth_assistant(m.get("content")))
        elif role == "system":
            msgs.append({"role": "system", "content": text_of(m.get("content"))})
        else:
            raise TranslationError(f"messages[{i}].role {role!r} is not supported",
                                   f"messages[{i}].role")
    out: dict[str, Any] = {"model": body.get("model"), "messages": msgs}
    if body.get("max_tokens") is not None:
        out["max_tokens"] = body["max_tokens"]
    for k in ("temperature", "top_p", "top_k", "stream"):
        if body.get(k) is not None:
            out[k] = body[k]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    if body.get("stream"):
        out["stream_options"] = {"include_usage": True}
    if body.get("tools"):
        out["tools"] = [{"type": "function", "function": {
            k2: v for k2, v in (("name", t.get("name")), ("description", t.get("description")),
                                ("parameters", t.get("input_schema"))) if v is not None}}
            for t in body["tools"]]
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        kind = tc.get("type")
        out["tool_choice"] = ({"type": "function", "function": {"name": tc.get("name")}}
                              if kind == "tool" else {"any": "required"}.get(kind, kind))
    th = body.get("thinking")
    if isinstance(th, dict) and th.get("type") in ("enabled", "adaptive", "disabled"):
        out["chat_template_kwargs"] = {"enable_thinking": th["type"] != "disabled"}
    return out


def _oa_user_blocks(content: Any, param: str) -> list[dict] | str:
    if isinstance(content, str) or content is None:
        return content or ""
    blocks = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") != "text":
            raise TranslationError(f"{param}[{j}]: part type cannot be translated (text only)",
                                   f"{param}[{j}].type")
        blocks.append({"type": "text", "text": str(p.get("text", ""))})
    return blocks


def openai_to_anthropic_request(body: dict) -> dict:
    system: list[str] = []
    msgs: list[dict] = []

    def push(role: str, blocks: list[dict]) -> None:
        if msgs and msgs[-1]["role"] == role and role == "user":
            msgs[-1]["content"].extend(blocks)  # tool results and text of one user turn
        else:
            msgs.append({"role": role, "content": blocks})

    for i, m in enumerate(body.get("messages") or []):
        role = m.get("role") if isinstance(m, dict) else None
        param = f"messages[{i}].content"
        if role in ("system", "developer"):
            if not msgs:
                system.append(text_of(m.get("content")))
            else:
                msgs.append({"role": "system", "content": text_of(m.get("content"))})
        elif role == "user":
            c = _oa_user_blocks(m.get("content"), param)
            push("user", [{"type": "text", "text": c}] if isinstance(c, str) else c)
        elif role == "tool":
            push("user", [{"type": "tool_result", "tool_use_id": str(m.get("tool_call_id", "")),
                           "content": text_of(m.get("content"))}])
        elif role == "assistant":
            blocks: list[dict] = []
            r = m.get("reasoning_content") or m.get("reasoning")
            if r:
                blocks.append({"type": "thinking", "thinking": r, "signature": signature(r)})
            t = text_of(m.get("content"))
            if t:
                blocks.append({"type": "text", "text": t})
            for j, c in enumerate(m.get("tool_calls") or []):
                fn = c.get("function") or {}
                blocks.append({"type": "tool_use", "id": c.get("id"), "name": fn.get("name"),
                               "input": _args_obj(fn.get("arguments"),
                                                  f"messages[{i}].tool_calls[{j}].arguments")})
            msgs.append({"role": "assistant", "content": blocks or ""})
        else:
            raise TranslationError(f"messages[{i}].role {role!r} is not supported",
                                   f"messages[{i}].role")
    out: dict[str, Any] = {"model": body.get("model"), "messages": msgs,
                           "max_tokens": body.get("max_completion_tokens")
                           or body.get("max_tokens") or DEFAULT_MAX_TOKENS}
    if system:
        out["system"] = "\n".join(system)
    for k in ("temperature", "top_p", "top_k", "stream"):
        if body.get(k) is not None:
            out[k] = body[k]
    stop = body.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("tools"):
        out["tools"] = [{"name": t["function"].get("name"),
                         "description": t["function"].get("description", ""),
                         "input_schema": t["function"].get("parameters")
                         or {"type": "object", "properties": {}}} for t in body["tools"]]
    tc = body.get("tool_choice")
    if isinstance(tc, str):
        out["tool_choice"] = {"type": {"required": "any"}.get(tc, tc)}
    elif isinstance(tc, dict):
        out["tool_choice"] = {"type": "tool", "name": (tc.get("function") or {}).get("name")}
    et = (body.get("chat_template_kwargs") or {}).get("enable_thinking")
    if et is False or body.get("reasoning_effort") == "none":
        out["thinking"] = {"type": "disabled"}
    return out


# ---- whole responses -----------------------------------------------------------------------

def anthropic_usage(prompt: int, cached: int, output: int) -> dict:
    return {"input_tokens": max(prompt - cached, 0), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}


def openai_usage(prompt: int, cached: int, output: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": output,
            "total_tokens": prompt + output, "prompt_tokens_details": {"cached_tokens": cached}}


def usage_from_openai(u: dict | None, timings: Any = None) -> tuple[int, int, int]:
    """(prompt, cached, output); cached from `prompt_tokens_details`, else llama.cpp's
    `timings.cache_n` (llama-server's own reuse counter, sent beside usage)."""
    u = u or {}
    det = u.get("prompt_tokens_details") or {}
    cached = det.get("cached_tokens")
    if cached is None and isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        cached = timings["cache_n"]
    return int(u.get("prompt_tokens") or 0), int(cached or 0), int(u.get("completion_tokens") or 0)


def usage_from_anthropic(u: dict | None) -> tuple[int, int, int]:
    u = u or {}
    cached = int(u.get("cache_read_input_tokens") or 0)
    prompt = int(u.get("input_tokens") or 0) + cached + int(
        u.get("cache_creation_input_tokens") or 0)
    return prompt, cached, int(u.get("output_tokens") or 0)


def openai_to_anthropic_response(resp: dict, model: str) -> dict:
    ch = (resp.get("choices") or [{}])[0]
    m = ch.get("message") or {}
    blocks: list[dict] = []
    r = m.get("reasoning_content") or m.get("reasoning")
    if r:
        blocks.append({"type": "thinking", "thinking": r, "signature": signature(r)})
    if m.get("content"):
        blocks.append({"type": "text", "text": text_of(m["content"])})
    for j, c in enumerate(m.get("tool_calls") or []):
        fn = c.get("function") or {}
        blocks.append({"type": "tool_use", "id": c.get("id") or f"toolu_{j}",
                       "name": fn.get("name"), "input": _args_obj(fn.get("arguments"),
                                                                  "arguments")})
    stop = STOP_TO_ANTHROPIC.get(ch.get("finish_reason") or "stop", "end_turn")
    return {"id": "msg_" + str(resp.get("id", "")).removeprefix("chatcmpl-"), "type": "message",
            "role": "assistant", "model": model, "content": blocks, "stop_reason": stop,
            "stop_sequence": None, "usage": anthropic_usage(*usage_from_openai(
                resp.get("usage"), resp.get("timings")))}


def anthropic_to_openai_response(resp: dict, model: str) -> dict:
    texts, thoughts, calls = [], [], []
    for b in resp.get("content") or []:
        if b.get("type") == "text":
            texts.append(b.get("text", ""))
        elif b.get("type") == "thinking":
            thoughts.append(b.get("thinking", ""))
        elif b.get("type") == "tool_use":
            calls.append({"id": b.get("id"), "type": "function", "function": {
                "name": b.get("name"), "arguments": json.dumps(b.get("input") or {},
                                                               ensure_ascii=False)}})
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return {"id": "chatcmpl-" + str(resp.get("id", "")).removeprefix("msg_"),
            "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": STOP_TO_OPENAI.get(
                resp.get("stop_reason") or "end_turn", "stop")}],
            "usage": openai_usage(*usage_from_anthropic(resp.get("usage")))}
