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

Response (`to_response` / `output_items`): reasoning -> a `reasoning` item with one
`summary_text`, text -> a `message` item with one `output_text` part, each tool call -> a
`function_call` (or `custom_tool_call`) item; usage as `input_tokens` (cached ones included,
as in the real API), `input_tokens_details.cached_tokens`, `output_tokens`.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from freetoken.chat.errors import ChatInputError

HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "image_generation", "computer_use_preview",
                "mcp", "local_shell"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text",
               "refusal"}
_SAMPLING = ("temperature", "top_p")
_UNSUPPORTED = {"background": "background responses are not supported",
                "conversation": "conversations are not supported; use previous_response_id"}


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
        if t in _TEXT_PARTS:
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
        elif kind in HOSTED_TOOLS:
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
    if isinstance(tc, dict) and tc.get("type") in HOSTED_TOOLS:
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
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for k in _SAMPLING:
        if body.get(k) is not None:
            chat[k] = body[k]
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat, names


def usage_from_chat(u: Any) -> dict:
    u = u if isinstance(u, dict) else {}
    p, o = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    det = u.get("prompt_tokens_details") if isinstance(u.get("prompt_tokens_details"), dict) else {}
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
    return response_object(rid, body, output, usage_from_chat(chat.get("usage")), status,
                           chat.get("created"))
