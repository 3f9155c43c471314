"""OpenAI `/v1/chat/completions` body -> TemplateInput (pure; raises ChatInputError)."""
from __future__ import annotations

from typing import Any

from freetoken.chat.errors import ChatInputError
from freetoken.chat.mapping import (
    TEXT_JOIN,
    TemplateInput,
    function_tool,
    need_dict,
    need_list,
    need_str,
    parse_arguments,
    thinking_from_bool,
    tool_call,
)

_ROLE_ALIASES = {"developer": "system"}
_ROLES = {"system", "user", "assistant", "tool"}


def _text(content: Any, param: str, allow_none: bool = False) -> str:
    """Content as one string: a string, or a list of `{"type":"text"}` parts."""
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatInputError(f"{param} must be a string or an array of text parts", param)
    texts: list[str] = []
    for j, part in enumerate(content):
        p = need_dict(part, f"{param}[{j}]")
        if p.get("type") != "text":
            raise ChatInputError(
                f"{param}[{j}]: content part type {p.get('type')!r} is not supported (text only)",
                f"{param}[{j}].type",
            )
        texts.append(need_str(p.get("text"), f"{param}[{j}].text"))
    return TEXT_JOIN.join(texts)


def _assistant(m: dict[str, Any], param: str) -> dict[str, Any]:
    calls = m.get("tool_calls")
    has_calls = isinstance(calls, list) and len(calls) > 0
    if "content" not in m and not has_calls:
        raise ChatInputError(f"{param}.content is required", f"{param}.content")
    out: dict[str, Any] = {"role": "assistant", "content": _text(m.get("content"),
                                                                 f"{param}.content", True)}
    for key in ("reasoning_content", "reasoning"):
        if m.get(key) is not None:
            out["reasoning_content"] = need_str(m[key], f"{param}.{key}")
            break
    if calls is not None:
        out_calls = []
        for j, c in enumerate(need_list(calls, f"{param}.tool_calls")):
            cp = f"{param}.tool_calls[{j}]"
            c = need_dict(c, cp)
            if c.get("type", "function") != "function":
                raise ChatInputError(f"{cp}.type must be 'function'", f"{cp}.type")
            fn = need_dict(c.get("function"), f"{cp}.function")
            args = parse_arguments(fn.get("arguments", "{}"), f"{cp}.function.arguments")
            out_calls.append(tool_call(c.get("id"), fn.get("name"), args, f"{cp}.function"))
        if out_calls:
            out["tool_calls"] = out_calls
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(need_list(tools, "tools")):
        t = need_dict(t, f"tools[{i}]")
        if t.get("type", "function") != "function":
            raise ChatInputError(f"tools[{i}].type must be 'function'", f"tools[{i}].type")
        fn = need_dict(t.get("function"), f"tools[{i}].function")
        out.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                                 f"tools[{i}].function"))
    return out or None


def _thinking(body: dict[str, Any]) -> bool | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        kw = need_dict(kwargs, "chat_template_kwargs")
        if "enable_thinking" in kw:
            return thinking_from_bool(kw["enable_thinking"], "chat_template_kwargs.enable_thinking")
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    need_str(effort, "reasoning_effort")
    return effort != "none"


def openai_to_template(body: dict[str, Any]) -> TemplateInput:
    """Map an OpenAI chat-completions body. Roles: system/developer (-> system), user,
    assistant (content, `tool_calls` with JSON-string arguments -> dicts, `reasoning_content` or
    `reasoning`), tool (content, `tool_call_id`). Thinking: `chat_template_kwargs.enable_thinking`
    wins over `reasoning_effort` ("none" -> False, any other level -> True); absent -> None."""
    body = need_dict(body, "body")
    msgs = need_list(body.get("messages"), "messages")
    if not msgs:
        raise ChatInputError("messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        param = f"messages[{i}]"
        m = need_dict(m, param)
        role = m.get("role")
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in _ROLES:
            raise ChatInputError(
                f"{param}.role {m.get('role')!r} is not supported", f"{param}.role"
            )
        if role == "assistant":
            out.append(_assistant(m, param))
            continue
        if "content" not in m or m["content"] is None:
            raise ChatInputError(f"{param}.content is required", f"{param}.content")
        msg: dict[str, Any] = {"role": role, "content": _text(m["content"], f"{param}.content")}
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = need_str(m["tool_call_id"], f"{param}.tool_call_id")
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return TemplateInput(out, _tools(body.get("tools")), _thinking(body))
