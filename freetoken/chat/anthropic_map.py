"""Anthropic `/v1/messages` body -> ChatRequest, in one walk (pure; raises ChatInputError).

`system` (string or text blocks) first, then `messages` (user/assistant/system roles; blocks
text, thinking -> reasoning_content, tool_use -> tool_calls, tool_result -> tool messages),
`tools` (name, description, input_schema) and `thinking` (enabled/adaptive -> True, disabled ->
False, absent -> None). Dropped as non-tokens: `cache_control`, thinking `signature`s,
`redacted_thinking` blocks, `is_error`, `metadata`, and system blocks starting with
`x-anthropic-billing-header` (Claude Code's per-session fingerprint, which would otherwise break
prefix sharing ~45 characters in).

Only custom tools (`type` absent or 'custom', with an `input_schema`): typed server tools such
as `web_search_20250305` or `bash_20250124` would need their schemas and executors, which this
server does not have, so they are refused — by this one rule, strict or not.
"""
from __future__ import annotations

from typing import Any, NoReturn

from freetoken.chat.mapping import (
    TEXT_JOIN,
    ChatRequest,
    Checks,
    TemplateInput,
    check_name,
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

BILLING_PREFIX = "x-anthropic-billing-header"
ROLES = ("user", "assistant", "system")
# the API's typing of blocks (strict): fields that must be strings when present / present at all
_BLOCK_FIELDS = {
    "text": ("text",), "thinking": ("thinking", "signature"), "redacted_thinking": ("data",),
    "tool_use": ("id", "name"), "tool_result": ("tool_use_id",),
}
_BLOCK_REQUIRED = {"text": ("text",), "thinking": ("thinking",), "tool_use": ("id", "name"),
                   "tool_result": ("tool_use_id",)}


def _block(b: Any, q: str, ck: Checks) -> str:
    """The checks every content block gets; returns its type. A tool_use adds its id to
    `ck.call_ids`; a tool_result must answer one of them (strict)."""
    if not (isinstance(b, dict) and isinstance(b.get("type"), str)):
        fail(f"'{q}' must be an object with a string 'type'", q)
    t = b["type"]
    if not ck.strict:
        return t
    for k in _BLOCK_REQUIRED.get(t, ()):
        if b.get(k) is None:
            fail(f"'{q}.{k}' is required", f"{q}.{k}")
    for k in _BLOCK_FIELDS.get(t, ()):
        opt_str(b, k, q)
    if t == "tool_use":
        check_name(b["name"], q + ".name")
        ck.call_ids.add(b["id"])
        if not isinstance(b.get("input", {}), dict):
            fail(f"'{q}.input' must be an object", q + ".input")
    elif t == "tool_result" and b["tool_use_id"] not in ck.call_ids:
        fail(f"'{q}.tool_use_id' {b['tool_use_id']!r} answers no tool_use block of an earlier "
             "assistant message", q + ".tool_use_id")
    return t


def _unsupported(t: str, q: str) -> NoReturn:
    fail(f"'{q}': content block type {t!r} is not supported here", f"{q}.type")


def _blocks(content: Any, param: str) -> list[Any]:
    return need_list(content, param, "a string or an array of content blocks")


def _text_blocks(content: Any, param: str, ck: Checks, drop_billing: bool = False) -> str:
    """A string, or text blocks joined; anything else is an error."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, b in enumerate(_blocks(content, param)):
        q = f"{param}[{j}]"
        if _block(b, q, ck) != "text":
            _unsupported(b["type"], q)
        text = need_str(b.get("text"), f"{q}.text")
        if not (drop_billing and text.startswith(BILLING_PREFIX)):
            texts.append(text)
    return TEXT_JOIN.join(texts)


def _user(content: Any, param: str, ck: Checks) -> list[dict[str, Any]]:
    """User content -> messages in block order: runs of text become one user message, each
    tool_result a `tool` message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush_text() -> None:
        if texts:
            out.append({"role": "user", "content": TEXT_JOIN.join(texts)})
            texts.clear()

    for j, b in enumerate(_blocks(content, param)):
        q = f"{param}[{j}]"
        kind = _block(b, q, ck)
        if kind == "text":
            texts.append(need_str(b.get("text"), f"{q}.text"))
        elif kind == "tool_result":
            flush_text()
            tool_id = need_str(b.get("tool_use_id"), f"{q}.tool_use_id", allow_empty=False)
            result = b.get("content")
            text = "" if result is None else _text_blocks(result, f"{q}.content", ck)
            out.append({"role": "tool", "content": text, "tool_call_id": tool_id})
        else:
            _unsupported(kind, q)
    flush_text()
    need(out, f"'{param}' must not be empty", param)
    return out


def _assistant(content: Any, param: str, ck: Checks) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(_blocks(content, param)):
        q = f"{param}[{j}]"
        kind = _block(b, q, ck)
        if kind == "text":
            texts.append(need_str(b.get("text"), f"{q}.text"))
        elif kind == "thinking":
            thoughts.append(need_str(b.get("thinking"), f"{q}.thinking"))
        elif kind == "tool_use":
            name = tool_name(b.get("name"), f"{q}.name", ck)
            calls.append(tool_call(b.get("id"), name,
                                   parse_arguments(b.get("input", {}), f"{q}.input")))
        elif kind != "redacted_thinking":  # redacted: opaque to us, nothing to render
            _unsupported(kind, q)
    msg: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts)}
    if thoughts:
        msg["reasoning_content"] = TEXT_JOIN.join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict[str, Any], ck: Checks) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text_blocks(body["system"], "system", ck, drop_billing=True)
        if system:
            out.append({"role": "system", "content": system})
    for i, m in enumerate(messages_list(body)):
        p = f"messages[{i}]"
        need_dict(m, p)
        role = m.get("role")
        if not (isinstance(role, str) and role in ROLES):  # str first: a list is unhashable
            fail(f"'{p}.role' must be 'user', 'assistant' or 'system', got {role!r}", f"{p}.role")
        if m.get("content") is None:
            fail(f"'{p}.content' is required", f"{p}.content")
        c, q = m["content"], f"{p}.content"
        if role == "user":
            out.extend(_user(c, q, ck))
        elif role == "assistant":
            out.append(_assistant(c, q, ck))
        else:
            out.append({"role": "system", "content": _text_blocks(c, q, ck)})
    return out


def _tools(tools: Any, ck: Checks) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(need_list(tools, "tools")):
        p = f"tools[{i}]"
        need_dict(t, p)
        kind = t.get("type")
        need(kind is None or kind == "custom", f"'{p}.type': tool type {kind!r} is not supported "
             "(custom tools only)", f"{p}.type")
        name = tool_name(t.get("name"), f"{p}.name", ck)
        need_dict(t.get("input_schema"), f"{p}.input_schema")
        out.append(function_tool(name, t.get("description"), t["input_schema"], p,
                                 f"{p}.input_schema", ck))
    unique_tools(out, "tools[{}].name", ck)
    return out or None


def _thinking(value: Any, ck: Checks) -> bool | None:
    """`budget_tokens` must be a positive integer (strict); the real API's floor of 1024 is not
    enforced (the budget is not used)."""
    if value is None:
        return None
    need_dict(value, "thinking")
    b = value.get("budget_tokens")
    ck.api(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1),
           "'thinking.budget_tokens' must be a positive integer", "thinking.budget_tokens")
    kind = value.get("type")
    if kind in ("enabled", "adaptive"):
        return True
    need(kind == "disabled", f"'thinking.type' {kind!r} is not supported", "thinking.type")
    return False


def anthropic_request(body: Any, strict: bool = True) -> ChatRequest:
    """Check and map a messages body; `strict`: with the API's own rules (also `metadata` an
    object and `stop_sequences` an array: fields not acted on here, refused when malformed as
    the real API does, so a client bug is not hidden) and `tool_choice`."""
    ck = Checks(strict)
    body = need_dict(body, "body")
    msgs = _messages(body, ck)
    ck.api(body.get("metadata") is None or isinstance(body["metadata"], dict),
           "'metadata' must be an object", "metadata")
    stops = body.get("stop_sequences")
    ck.api(stops is None or isinstance(stops, list), "'stop_sequences' must be an array of "
           "strings", "stop_sequences")
    tools = _tools(body.get("tools"), ck)
    thinking = _thinking(body.get("thinking"), ck)
    # gpt-oss always reasons: thinking disabled asks for its lowest effort
    ti = TemplateInput(msgs, tools, thinking, "low" if thinking is False else None)
    return ChatRequest(ti, tool_choice(body.get("tool_choice"), tools, "anthropic")
                       if strict else "auto")


def anthropic_to_template(body: Any) -> TemplateInput:
    """The template input of a messages body, with only the checks rendering needs."""
    return anthropic_request(body, strict=False).template
