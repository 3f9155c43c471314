"""OpenAI `/v1/chat/completions` body -> ChatRequest, in one walk (pure; raises ChatInputError).

Roles: system/developer (-> system), user, assistant (content, `tool_calls` with JSON-string
arguments -> dicts, `reasoning_content` or `reasoning`), tool (content, `tool_call_id`). The
legacy `function` role is refused. Thinking: `chat_template_kwargs.enable_thinking` wins over
`reasoning_effort` ("none" -> False, any other level -> True); absent -> None. The effort level
itself (`chat_template_kwargs.reasoning_effort` first) goes to gpt-oss's system message
(`mapping.effort_level`).
"""
from __future__ import annotations

from typing import Any

from freetoken.chat.mapping import (
    TEXT_JOIN,
    ChatRequest,
    Checks,
    TemplateInput,
    effort_level,
    fail,
    function_tool,
    messages_list,
    need,
    need_dict,
    need_list,
    need_str,
    opt_str,
    parse_arguments,
    tool_call,
    tool_choice,
    tool_name,
    unique_tools,
)

ROLES = {"system", "developer", "user", "assistant", "tool"}
_ROLE_ALIASES = {"developer": "system"}


def _text(content: Any, param: str) -> str:
    """Content as one string: a string, or a list of `{"type":"text"}` parts."""
    if isinstance(content, str):
        return content
    need_list(content, param, "a string or an array of content parts")
    texts: list[str] = []
    for j, part in enumerate(content):
        q = f"{param}[{j}]"
        if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
            fail(f"'{q}' must be an object with a string 'type'", q)
        if part["type"] != "text":
            fail(f"'{q}': content part type {part['type']!r} is not supported (text only)",
                 f"{q}.type")
        texts.append(need_str(part.get("text"), f"{q}.text"))
    return TEXT_JOIN.join(texts)


def _calls(calls: Any, param: str, ck: Checks) -> list[dict[str, Any]]:
    """`tool_calls` of a message; their ids join `ck.call_ids`."""
    out = []
    for j, c in enumerate(need_list(calls, f"{param}.tool_calls")):
        cp = f"{param}.tool_calls[{j}]"
        need_dict(c, cp)
        fn = need_dict(c.get("function"), f"{cp}.function")
        opt_str(c, "id", cp)
        if isinstance(c.get("id"), str):
            ck.call_ids.add(c["id"])
        name = tool_name(fn.get("name"), f"{cp}.function.name", ck)
        if c.get("type", "function") != "function":
            fail(f"'{cp}.type' must be 'function'", f"{cp}.type")
        args = parse_arguments(fn.get("arguments", "{}"), f"{cp}.function.arguments")
        out.append(tool_call(c.get("id"), name, args))
    return out


def _message(m: Any, param: str, ck: Checks) -> dict[str, Any]:
    need_dict(m, param)
    role = m.get("role")
    if not (isinstance(role, str) and role in ROLES):  # str first: a list is unhashable
        fail(f"'{param}.role' must be one of {sorted(ROLES)}, got {role!r}", f"{param}.role")
    role = _ROLE_ALIASES.get(role, role)
    if ck.strict:  # typed by the API whatever the role, though rendering reads some only
        for k in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            opt_str(m, k, param)
    calls = m.get("tool_calls")
    content = m.get("content")
    # an assistant message may omit content when it carries tool calls
    if content is None and (role != "assistant" or ("content" not in m and not calls)):
        fail(f"'{param}.content' is required", f"{param}.content")
    out: dict[str, Any] = {"role": role,
                           "content": "" if content is None else _text(content,
                                                                       f"{param}.content")}
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None:
            out["tool_call_id"] = need_str(call_id, f"{param}.tool_call_id")
            if ck.strict and call_id not in ck.call_ids:
                fail(f"'{param}.tool_call_id' {call_id!r} answers no tool call of an earlier "
                     "assistant message", f"{param}.tool_call_id")
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    if role == "assistant":
        for key in ("reasoning_content", "reasoning"):
            if m.get(key) is not None:
                out["reasoning_content"] = need_str(m[key], f"{param}.{key}")
                break
    if calls is not None and (role == "assistant" or ck.strict):
        mapped = _calls(calls, param, ck)
        if mapped and role == "assistant":
            out["tool_calls"] = mapped
    return out


def _tools(tools: Any, ck: Checks) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(need_list(tools, "tools")):
        p = f"tools[{i}]"
        need_dict(t, p)
        need(t.get("type", "function") == "function", f"'{p}.type' must be 'function'",
             f"{p}.type")
        fn = need_dict(t.get("function"), f"{p}.function")
        name = tool_name(fn.get("name"), f"{p}.function.name", ck)
        out.append(function_tool(name, fn.get("description"), fn.get("parameters"),
                                 f"{p}.function", f"{p}.function.parameters", ck))
    unique_tools(out, "tools[{}].function.name", ck)
    return out or None


def _thinking(body: dict[str, Any]) -> bool | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        kw = need_dict(kwargs, "chat_template_kwargs")
        if "enable_thinking" in kw:
            v = kw["enable_thinking"]
            need(v is None or isinstance(v, bool), "'chat_template_kwargs.enable_thinking' "
                 "must be a boolean", "chat_template_kwargs.enable_thinking")
            return v
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    return need_str(effort, "reasoning_effort") != "none"


def openai_request(body: Any, strict: bool = True) -> ChatRequest:
    """Check and map a chat-completions body; `strict`: with the API's own rules and
    `tool_choice` (see `freetoken.chat.mapping`)."""
    ck = Checks(strict)
    body = need_dict(body, "body")
    msgs = [_message(m, f"messages[{i}]", ck) for i, m in enumerate(messages_list(body))]
    tools = _tools(body.get("tools"), ck)
    kw = body.get("chat_template_kwargs")
    effort = kw.get("reasoning_effort") if isinstance(kw, dict) else None
    param = "chat_template_kwargs.reasoning_effort"
    if effort is None:
        effort, param = body.get("reasoning_effort"), "reasoning_effort"
    ti = TemplateInput(msgs, tools, _thinking(body), effort_level(effort, param))
    return ChatRequest(ti, tool_choice(body.get("tool_choice"), tools, "openai")
                       if strict else "auto")


def openai_to_template(body: Any) -> TemplateInput:
    """The template input of a chat-completions body, with only the checks rendering needs."""
    return openai_request(body, strict=False).template
