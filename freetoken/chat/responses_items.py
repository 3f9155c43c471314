"""The response side of the Responses API mapping (chat/responses_map.py has the contract):
a chat completion's message as Responses output items (`reasoning`, `message`,
`function_call` / `custom_tool_call`), the `response` object, its usage, and `ToolNames`, what
each chat tool name of the request stands for, which the request side fills."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from freetoken.chat.errors import ChatInputError


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ToolNames:
    """What each chat tool name stands for in the Responses request: (kind, namespace)."""

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[str, str | None]] = {}

    def add(self, name: str, kind: str, namespace: str | None, param: str) -> None:
        if name in self.kinds:
            raise ChatInputError(f"duplicate tool name {name!r}", param)
        self.kinds[name] = (kind, namespace)

    def kind(self, name: str) -> tuple[str, str | None]:
        return self.kinds.get(name, ("function", None))


def usage_from_chat(u: Any, timings: Any = None) -> dict:
    """Responses usage from a chat `usage`; the cached tokens from its
    `prompt_tokens_details.cached_tokens`, else llama.cpp's `timings.cache_n` (an upstream
    llama-server's own reuse counter, which it reports there and not in usage)."""
    u = u if isinstance(u, dict) else {}
    p, o = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    det = u.get("prompt_tokens_details") if isinstance(u.get("prompt_tokens_details"), dict) else {}
    if "cached_tokens" not in det and isinstance(timings, dict) and isinstance(
            timings.get("cache_n"), int):
        det = {"cached_tokens": timings["cache_n"]}
    out_det = (u.get("completion_tokens_details")
               if isinstance(u.get("completion_tokens_details"), dict) else {})
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": int(
        det.get("cached_tokens") or 0)}, "output_tokens": o, "output_tokens_details": {
        "reasoning_tokens": int(out_det.get("reasoning_tokens") or 0)}, "total_tokens": p + o}


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs_"),
            "summary": [{"type": "summary_text", "text": text}]}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id or new_id("msg_"), "status": status,
            "role": "assistant", "content": [{"type": "output_text", "text": text,
                                              "annotations": []}]}


def call_item(call_id: str, name: str, arguments: str, names: ToolNames,
              item_id: str | None = None, status: str = "completed") -> dict:
    kind, ns = names.kind(name)
    if kind == "custom":
        try:
            inp = json.loads(arguments).get("input", arguments)
        except (ValueError, AttributeError):
            inp = arguments
        return {"type": "custom_tool_call", "id": item_id or new_id("ctc_"), "status": status,
                "call_id": call_id, "name": name, "input": inp if isinstance(inp, str)
                else json.dumps(inp)}
    item = {"type": "function_call", "id": item_id or new_id("fc_"), "status": status,
            "call_id": call_id, "name": name, "arguments": arguments}
    if ns:
        item["namespace"] = ns
    return item


def output_items(message: dict, names: ToolNames) -> list[dict]:
    """The output items of one chat completion message."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(str(message["reasoning_content"])))
    if message.get("content"):
        out.append(message_item(str(message["content"])))
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        out.append(call_item(str(tc.get("id") or new_id("call_")), str(fn.get("name", "")),
                             str(fn.get("arguments") or ""), names))
    return out


def response_object(rid: str, body: dict, output: list[dict], usage: dict | None,
                    status: str, created: int | None = None) -> dict:
    """A Responses `response` object for request `body` (status: in_progress, completed or
    incomplete)."""
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    return {
        "id": rid, "object": "response", "created_at": created or int(time.time()),
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get(
            "max_output_tokens"), "model": body.get("model") or "", "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": body.get("store", True), "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": "disabled",
        "usage": usage, "user": None, "metadata": body.get("metadata") or {}}


def to_response(chat: dict, rid: str, body: dict, names: ToolNames) -> dict:
    """A non-streamed chat completion as a Responses `response`."""
    choice = (chat.get("choices") or [{}])[0]
    output = output_items(choice.get("message") or {}, names)
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    return response_object(rid, body, output, usage_from_chat(chat.get("usage"),
                                                              chat.get("timings")), status,
                           chat.get("created"))
