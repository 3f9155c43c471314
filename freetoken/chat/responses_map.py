"""OpenAI Responses API <-> chat completions, for `POST /v1/responses` on `ft serve` and the
proxy (which serve it by translating to their own chat route, whatever engine is behind).

Request (`to_chat`): `instructions` and the `input` items become chat messages in order.
History is rendered **byte-stably**: the items of one model turn (reasoning, assistant message,
function calls, in any order they were emitted) fold into the one assistant message the model
produced, so a turn's prompt plus its reply re-renders as a prefix of the next turn's prompt
and the engine reuses it (Codex re-sends the whole history every request). Items:

| item | chat |
|---|---|
| `message` user, system, developer (-> system) | that message; text parts joined by "\\n" |
| `message` assistant | content of the turn's assistant message |
| `reasoning` (summary or `reasoning_text` content) | the turn's `reasoning_content` |
| `function_call` / `custom_tool_call` | a tool call of the turn (custom: `{"input": ...}`) |
| `function_call_output` / `custom_tool_call_output` | a `tool` message |

Tools: `function` as is; `namespace` (Codex's `multi_agent_v1`) contributes its function tools,
described as belonging to the namespace, and calls of them carry `namespace` back; `custom`
(freeform input) becomes a function with one string parameter `input`. Hosted tools
(`web_search`, `file_search`, `code_interpreter`, `image_generation`, `computer_use_preview`,
`mcp`, `local_shell`) are accepted and not shown to the model: there is no executor for them
here, and Codex sends `web_search` with every request. Anything else is a 400.

Response (`to_response` / `output_items`, in chat/responses_items.py): reasoning -> a
`reasoning` item with one `summary_text`, text -> a `message` item with one `output_text`
part, each tool call -> a `function_call` (or `custom_tool_call`) item; usage as
`input_tokens` (cached ones included, as in the real API), `input_tokens_details.cached_tokens`,
`output_tokens`.
"""
from __future__ import annotations

import json
from typing import Any

from freetoken.chat.errors import ChatInputError
from freetoken.chat.responses_items import (  # noqa: F401  (the response side, re-exported)
    ToolNames,
    call_item,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    response_object,
    to_response,
    usage_from_chat,
)

HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "image_generation", "computer_use_preview",
                "mcp", "local_shell"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text",
               "refusal"}
_SAMPLING = ("temperature", "top_p")
_UNSUPPORTED = {"background": "background responses are not supported",
                "conversation": "conversations are not supported; use previous_response_id"}


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatInputError("content must be a string or a list of parts", param)
    out = []
    for i, p in enumerate(content):
        t = p.get("type") if isinstance(p, dict) else None
        if isinstance(t, str) and t in _TEXT_PARTS:
            out.append(str(p.get("text", p.get("refusal", ""))))
        else:
            raise ChatInputError(f"content part type {t!r} is not supported by this server "
                                 "(text only)", f"{param}[{i}].type")
    return "\n".join(out)


def _function_tool(t: dict, param: str, description: str | None = None) -> dict:
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise ChatInputError("a function tool needs a name", f"{param}.name")
    params = t.get("parameters")
    fn: dict[str, Any] = {"name": name, "description": description or t.get("description") or "",
                          "parameters": params if isinstance(params, dict)
                          else {"type": "object", "properties": {}}}
    return {"type": "function", "function": fn}


def tools_to_chat(tools: Any) -> tuple[list[dict], ToolNames]:
    names = ToolNames()
    out: list[dict] = []
    if tools is None:
        return out, names
    if not isinstance(tools, list):
        raise ChatInputError("tools must be an array", "tools")
    for i, t in enumerate(tools):
        param = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            out.append(_function_tool(t, param))
            names.add(t["name"], "function", None, param)
        elif kind == "namespace":
            ns = str(t.get("name") or "")
            for j, sub in enumerate(t.get("tools") or []):
                sp = f"{param}.tools[{j}]"
                if not isinstance(sub, dict) or sub.get("type") != "function":
                    raise ChatInputError("namespace tools must be function tools", f"{sp}.type")
                desc = f"[{ns}: {t.get('description') or ''}] {sub.get('description') or ''}"
                out.append(_function_tool(sub, sp, desc.strip()))
                names.add(sub["name"], "function", ns, sp)
        elif kind == "custom":
            name = t.get("name")
            if not isinstance(name, str) or not name:
                raise ChatInputError("a custom tool needs a name", f"{param}.name")
            out.append({"type": "function", "function": {
                "name": name, "description": t.get("description") or "",
                "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                               "required": ["input"]}}})
            names.add(name, "custom", None, param)
        elif isinstance(kind, str) and kind in HOSTED_TOOLS:  # (a list/dict: unhashable)
            continue  # accepted, not offered: no executor here (module docstring)
        else:
            raise ChatInputError(f"tool type {kind!r} is not supported by this server "
                                 "(function, custom and namespace tools; hosted tools are "
                                 "accepted and not used)", f"{param}.type")
    return out, names


class _Turns:
    """Builds chat messages, folding one model turn's items into one assistant message."""

    def __init__(self) -> None:
        self.msgs: list[dict] = []
        self.turn: dict[str, Any] | None = None

    def assistant(self) -> dict[str, Any]:
        if self.turn is None:
            self.turn = {"role": "assistant", "content": ""}
            self.msgs.append(self.turn)
        return self.turn

    def close(self) -> None:
        self.turn = None

    def reasoning(self, text: str) -> None:
        t = self.turn
        if t is not None and (t["content"] or t.get("tool_calls")):
            self.close()  # reasoning after output: the next model turn
        a = self.assistant()
        a["reasoning_content"] = (a.get("reasoning_content", "") + "\n" + text
                                  if a.get("reasoning_content") else text)

    def text(self, text: str) -> None:
        if self.turn is not None and self.turn.get("tool_calls"):
            self.close()
        a = self.assistant()
        a["content"] = a["content"] + "\n" + text if a["content"] else text

    def call(self, call_id: str, name: str, arguments: str) -> None:
        self.assistant().setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name,
                                                             "arguments": arguments}})

    def other(self, msg: dict) -> None:
        self.close()
        self.msgs.append(msg)


def items_to_messages(items: list[Any], instructions: str | None = None) -> list[dict]:
    b = _Turns()
    if instructions:
        b.other({"role": "system", "content": instructions})
    for i, it in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(it, dict):
            raise ChatInputError("an input item must be an object", param)
        kind = it.get("type") or ("message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            text = _text(it.get("content"), f"{param}.content")
            if role == "assistant":
                b.text(text)
            elif role in ("user", "system", "developer"):
                b.other({"role": "system" if role == "developer" else role, "content": text})
            else:
                raise ChatInputError(f"message role {role!r} is not supported", f"{param}.role")
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            b.reasoning(_text(parts, f"{param}.summary"))
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = it.get("call_id"), it.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise ChatInputError(f"{kind} needs call_id and name", param)
            args = (it.get("arguments") if kind == "function_call"
                    else json.dumps({"input": it.get("input", "")}, ensure_ascii=False))
            b.call(call_id, name, args if isinstance(args, str) else json.dumps(args))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = it.get("call_id")
            if not isinstance(call_id, str):
                raise ChatInputError(f"{kind} needs call_id", f"{param}.call_id")
            b.other({"role": "tool", "tool_call_id": call_id,
                     "content": _text(it.get("output"), f"{param}.output")})
        else:
            raise ChatInputError(f"input item type {kind!r} is not supported by this server",
                                 f"{param}.type")
    return b.msgs


def input_items(body: dict) -> list[Any]:
    """`input` as a list of items (a string is one user message)."""
    inp = body.get("input")
    if isinstance(inp, str):
        return [{"type": "message", "role": "user", "content": inp}]
    if isinstance(inp, list):
        return inp
    raise ChatInputError("input must be a string or an array of items", "input")


def _tool_choice(tc: Any) -> Any:
    if tc is None or tc in ("auto", "none", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and tc.get("name"):
        return {"type": "function", "function": {"name": tc["name"]}}
    if isinstance(tc, dict) and isinstance(tc.get("type"), str) and tc["type"] in HOSTED_TOOLS:
        return "auto"
    raise ChatInputError("tool_choice must be auto, none, required or a function", "tool_choice")


def to_chat(body: dict, items: list[Any]) -> tuple[dict, ToolNames]:
    """The chat completions request for a Responses request whose full input is `items`."""
    for k, why in _UNSUPPORTED.items():
        if body.get(k):
            raise ChatInputError(why, k)
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise ChatInputError("text.format other than 'text' is not supported (no constrained "
                             "decoding)", "text.format")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ChatInputError("instructions must be a string", "instructions")
    tools, names = tools_to_chat(body.get("tools"))
    chat: dict[str, Any] = {"model": body.get("model") or "", "stream": bool(body.get("stream")),
                            "messages": items_to_messages(items, instructions)}
    if tools:
        chat["tools"] = tools
        tc = _tool_choice(body.get("tool_choice"))
        if tc is not None:
            chat["tool_choice"] = tc
        if isinstance(body.get("parallel_tool_calls"), bool):
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]  # checked by the chat mapping
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for k in _SAMPLING:
        if body.get(k) is not None:
            chat[k] = body[k]
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat, names
