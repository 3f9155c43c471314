"""Anthropic `/v1/messages` body -> TemplateInput (pure; raises ChatInputError).

Dropped as non-tokens: `cache_control`, thinking `signature`s, `redacted_thinking` blocks,
`is_error`, `metadata`, and system blocks starting with `x-anthropic-billing-header` (Claude
Code's per-session fingerprint, which would otherwise break prefix sharing ~45 characters in).
"""
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
    tool_call,
)

BILLING_PREFIX = "x-anthropic-billing-header"


def _unsupported(block: dict[str, Any], param: str) -> ChatInputError:
    return ChatInputError(
        f"{param}: content block type {block.get('type')!r} is not supported here", f"{param}.type"
    )


def _text_blocks(content: Any, param: str, drop_billing: bool = False) -> str:
    """A string, or text blocks joined; anything else is an error."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, b in enumerate(need_list(content, param)):
        b = need_dict(b, f"{param}[{j}]")
        if b.get("type") != "text":
            raise _unsupported(b, f"{param}[{j}]")
        text = need_str(b.get("text"), f"{param}[{j}].text")
        if drop_billing and text.startswith(BILLING_PREFIX):
            continue
        texts.append(text)
    return TEXT_JOIN.join(texts)


def _user(content: Any, param: str) -> list[dict[str, Any]]:
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

    for j, b in enumerate(need_list(content, param)):
        bp = f"{param}[{j}]"
        b = need_dict(b, bp)
        kind = b.get("type")
        if kind == "text":
            texts.append(need_str(b.get("text"), f"{bp}.text"))
        elif kind == "tool_result":
            flush_text()
            tool_id = need_str(b.get("tool_use_id"), f"{bp}.tool_use_id", allow_empty=False)
            result = b.get("content")
            text = "" if result is None else _text_blocks(result, f"{bp}.content")
            out.append({"role": "tool", "content": text, "tool_call_id": tool_id})
        else:
            raise _unsupported(b, bp)
    flush_text()
    if not out:
        raise ChatInputError(f"{param} must not be empty", param)
    return out


def _assistant(content: Any, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(need_list(content, param)):
        bp = f"{param}[{j}]"
        b = need_dict(b, bp)
        kind = b.get("type")
        if kind == "text":
            texts.append(need_str(b.get("text"), f"{bp}.text"))
        elif kind == "thinking":
            thoughts.append(need_str(b.get("thinking"), f"{bp}.thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque to us: nothing to render
        elif kind == "tool_use":
            args = parse_arguments(b.get("input", {}), f"{bp}.input")
            calls.append(tool_call(b.get("id"), b.get("name"), args, bp))
        else:
            raise _unsupported(b, bp)
    msg: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts)}
    if thoughts:
        msg["reasoning_content"] = TEXT_JOIN.join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(need_list(tools, "tools")):
        t = need_dict(t, f"tools[{i}]")
        if t.get("type", "custom") != "custom":
            raise ChatInputError(
                f"tools[{i}]: tool type {t.get('type')!r} is not supported (custom tools only)",
                f"tools[{i}].type",
            )
        schema = need_dict(t.get("input_schema"), f"tools[{i}].input_schema")
        out.append(function_tool(t.get("name"), t.get("description"), schema, f"tools[{i}]"))
    return out or None


def _thinking(value: Any) -> bool | None:
    if value is None:
        return None
    kind = need_dict(value, "thinking").get("type")
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise ChatInputError(f"thinking.type {kind!r} is not supported", "thinking.type")


def anthropic_to_template(body: dict[str, Any]) -> TemplateInput:
    """Map an Anthropic messages body: `system` (string or text blocks) first, then `messages`
    (user/assistant/system roles; blocks text, thinking -> reasoning_content, tool_use ->
    tool_calls, tool_result -> tool messages), `tools` (name, description, input_schema) and
    `thinking` (enabled/adaptive -> True, disabled -> False, absent -> None)."""
    body = need_dict(body, "body")
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text_blocks(body["system"], "system", drop_billing=True)
        if system:
            out.append({"role": "system", "content": system})
    msgs = need_list(body.get("messages"), "messages")
    if not msgs:
        raise ChatInputError("messages must not be empty", "messages")
    for i, m in enumerate(msgs):
        param = f"messages[{i}]"
        m = need_dict(m, param)
        if "content" not in m or m["content"] is None:
            raise ChatInputError(f"{param}.content is required", f"{param}.content")
        role = m.get("role")
        if role == "user":
            out.extend(_user(m["content"], f"{param}.content"))
        elif role == "assistant":
            out.append(_assistant(m["content"], f"{param}.content"))
        elif role == "system":
            out.append({"role": "system", "content": _text_blocks(m["content"],
                                                                  f"{param}.content")})
        else:
            raise ChatInputError(f"{param}.role {role!r} is not supported", f"{param}.role")
    return TemplateInput(out, _tools(body.get("tools")), _thinking(body.get("thinking")))
