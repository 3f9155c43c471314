"""Structural checks of messages and tools for both API families.

They guarantee the shapes the chat-template conversion relies on (lists of objects, string
fields where strings are expected, tool schemas that are JSON-Schema objects), so malformed
input is answered with a 400 naming the offending field instead of failing deep inside the
template. Content semantics (which block types a model supports) stay with `freetoken.chat`.
"""
from __future__ import annotations

from typing import Any

from freetoken.server.errors import APIError

# the roles the chat mapping renders (the legacy `function` role is refused here, not there)
OPENAI_ROLES = {"system", "developer", "user", "assistant", "tool"}
ANTHROPIC_ROLES = {"user", "assistant", "system"}
MAX_NAME = 256


def _bad(msg: str, param: str) -> APIError:
    return APIError.bad(msg, param)


def _need(cond: bool, msg: str, param: str) -> None:
    if not cond:
        raise _bad(msg, param)


def _opt_str(d: dict, key: str, param: str) -> None:
    _need(d.get(key) is None or isinstance(d.get(key), str), f"'{param}.{key}' must be a string",
          param + "." + key)


def check_name(name: Any, param: str) -> str:
    ok = (isinstance(name, str) and 0 < len(name) <= MAX_NAME
          and not any(c.isspace() or ord(c) < 32 for c in name))
    _need(ok, f"'{param}' must be a non-empty name without whitespace (at most {MAX_NAME} chars)",
          param)
    return name  # type: ignore[return-value]


def check_schema(schema: Any, param: str) -> None:
    """A tool's parameter schema: a JSON-Schema object describing an object."""
    _need(isinstance(schema, dict), f"'{param}' must be a JSON Schema object", param)
    t = schema.get("type")
    _need(t is None or t == "object" or (isinstance(t, list) and "object" in t),
          f"'{param}' must be a JSON Schema of type 'object', got type {t!r}", param)
    props = schema.get("properties")
    _need(props is None or (isinstance(props, dict) and all(isinstance(v, (dict, bool))
                                                            for v in props.values())),
          f"'{param}.properties' must map property names to schemas", param + ".properties")
    req = schema.get("required")
    _need(req is None or (isinstance(req, list) and all(isinstance(r, str) for r in req)),
          f"'{param}.required' must be an array of strings", param + ".required")


def _role(m: dict, allowed: set[str], p: str, expect: str) -> str:
    role = m.get("role")
    _need(isinstance(role, str) and role in allowed,  # str first: a list role is unhashable
          f"'{p}.role' must be {expect}, got {role!r}"[:300], p + ".role")
    return role  # type: ignore[return-value]


def _unique(names: list[str], param: str) -> list[str]:
    seen: set[str] = set()
    for i, n in enumerate(names):
        _need(n not in seen, f"tool names must be unique; {n!r} appears twice", f"{param}{i}")
        seen.add(n)
    return names


def openai_tools(tools: Any) -> list[str]:
    """Validate OpenAI `tools`; returns the function names."""
    if tools is None:
        return []
    _need(isinstance(tools, list), "'tools' must be an array", "tools")
    names = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        _need(isinstance(t, dict), f"'{p}' must be an object", p)
        _need(t.get("type", "function") == "function", f"'{p}.type' must be 'function'",
              p + ".type")
        fn = t.get("function")
        _need(isinstance(fn, dict), f"'{p}.function' is required and must be an object",
              p + ".function")
        names.append(check_name(fn.get("name"), p + ".function.name"))
        _opt_str(fn, "description", p + ".function")
        if fn.get("parameters") is not None:
            check_schema(fn["parameters"], p + ".function.parameters")
    return _unique(names, "tools[")


def anthropic_tools(tools: Any) -> list[str]:
    """Validate Anthropic `tools`; returns the tool names. Only custom tools (`type` absent or
    'custom', with an `input_schema`): typed server tools such as `web_search_20250305` or
    `bash_20250124` would need their schemas and executors, which this server does not have,
    so they are refused here (the chat mapping refuses them the same way)."""
    if tools is None:
        return []
    _need(isinstance(tools, list), "'tools' must be an array", "tools")
    names = []
    for i, t in enumerate(tools):
        p = f"tools.{i}"
        _need(isinstance(t, dict), f"'{p}' must be an object", p)
        names.append(check_name(t.get("name"), p + ".name"))
        _opt_str(t, "description", p)
        kind = t.get("type")
        _need(kind is None or kind == "custom", f"'{p}.type': tool type {kind!r} is not "
              "supported (custom tools only)"[:300], p + ".type")
        check_schema(t.get("input_schema"), p + ".input_schema")
    return _unique([str(n) for n in names], "tools.")


def _openai_content(c: Any, p: str) -> None:
    if c is None or isinstance(c, str):
        return
    _need(isinstance(c, list), f"'{p}' must be a string or an array of content parts", p)
    for j, part in enumerate(c):
        q = f"{p}[{j}]"
        _need(isinstance(part, dict) and isinstance(part.get("type"), str),
              f"'{q}' must be an object with a string 'type'", q)
        if part["type"] == "text":
            _need(isinstance(part.get("text"), str), f"'{q}.text' must be a string", q + ".text")


def openai_messages(msgs: Any) -> None:
    """Also refuses a tool message whose `tool_call_id` answers no earlier assistant tool call
    (as OpenAI does); a tool message without an id is accepted (some clients omit it)."""
    _need(isinstance(msgs, list) and len(msgs) > 0, "'messages' must be a non-empty array",
          "messages")
    call_ids: set[str] = set()
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        _need(isinstance(m, dict), f"'{p}' must be an object", p)
        role = _role(m, OPENAI_ROLES, p, f"one of {sorted(OPENAI_ROLES)}")
        _openai_content(m.get("content"), p + ".content")
        for k in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            _opt_str(m, k, p)
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            _need(m["tool_call_id"] in call_ids, f"'{p}.tool_call_id' "
                  f"{m['tool_call_id']!r} answers no tool call of an earlier assistant "
                  "message"[:300], p + ".tool_call_id")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        _need(isinstance(calls, list), f"'{p}.tool_calls' must be an array", p + ".tool_calls")
        for j, tc in enumerate(calls):
            q = f"{p}.tool_calls[{j}]"
            _need(isinstance(tc, dict) and isinstance(tc.get("function"), dict),
                  f"'{q}.function' must be an object", q + ".function")
            _opt_str(tc, "id", q)
            if isinstance(tc.get("id"), str):
                call_ids.add(tc["id"])
            check_name(tc["function"].get("name"), q + ".function.name")
            args = tc["function"].get("arguments")
            _need(args is None or isinstance(args, (str, dict)),
                  f"'{q}.function.arguments' must be a JSON string", q + ".function.arguments")


_BLOCK_FIELDS = {  # block type -> fields that must be strings when present
    "text": ("text",), "thinking": ("thinking", "signature"), "redacted_thinking": ("data",),
    "tool_use": ("id", "name"), "tool_result": ("tool_use_id",),
}
_BLOCK_REQUIRED = {"text": ("text",), "thinking": ("thinking",), "tool_use": ("id", "name"),
                   "tool_result": ("tool_use_id",)}


def _anthropic_blocks(c: Any, p: str, allow_str: bool = True,
                      use_ids: set[str] | None = None) -> None:
    """`use_ids`: tool_use ids seen so far; given, tool_use blocks add to it and a tool_result
    must answer one of them (as the Anthropic API requires)."""
    if allow_str and isinstance(c, str):
        return
    _need(isinstance(c, list), f"'{p}' must be a string or an array of content blocks", p)
    for j, b in enumerate(c):
        q = f"{p}.{j}"
        _need(isinstance(b, dict) and isinstance(b.get("type"), str),
              f"'{q}' must be an object with a string 'type'", q)
        t = b["type"]
        for k in _BLOCK_REQUIRED.get(t, ()):
            _need(b.get(k) is not None, f"'{q}.{k}' is required", f"{q}.{k}")
        for k in _BLOCK_FIELDS.get(t, ()):
            _opt_str(b, k, q)
        if t == "tool_use":
            check_name(b["name"], q + ".name")
            if use_ids is not None:
                use_ids.add(b["id"])
            _need(isinstance(b.get("input", {}), dict), f"'{q}.input' must be an object",
                  q + ".input")
        if t == "tool_result" and use_ids is not None:
            _need(b["tool_use_id"] in use_ids, f"'{q}.tool_use_id' {b['tool_use_id']!r} answers "
                  "no tool_use block of an earlier assistant message"[:300], q + ".tool_use_id")
        if t == "tool_result" and b.get("content") is not None:
            _anthropic_blocks(b["content"], q + ".content")


def anthropic_messages(msgs: Any, system: Any) -> None:
    if system is not None:
        _anthropic_blocks(system, "system")
    _need(isinstance(msgs, list) and len(msgs) > 0, "'messages' must be a non-empty array",
          "messages")
    use_ids: set[str] = set()
    for i, m in enumerate(msgs):
        p = f"messages.{i}"
        _need(isinstance(m, dict), f"'{p}' must be an object", p)
        _role(m, ANTHROPIC_ROLES, p, "'user' or 'assistant'")
        _need(m.get("content") is not None, f"'{p}.content' is required", p + ".content")
        _anthropic_blocks(m["content"], p + ".content", use_ids=use_ids)


def anthropic_fields(body: dict) -> None:
    """Top-level fields the API types strictly and we otherwise ignore: refused when malformed,
    as the real API does, so a client bug is not hidden. `thinking.budget_tokens` must be a
    positive integer; the real API's floor of 1024 is not enforced (the budget is not used)."""
    _need(body.get("metadata") is None or isinstance(body["metadata"], dict),
          "'metadata' must be an object", "metadata")
    stops = body.get("stop_sequences")
    _need(stops is None or isinstance(stops, list), "'stop_sequences' must be an array of "
          "strings", "stop_sequences")
    th = body.get("thinking")
    if isinstance(th, dict) and th.get("budget_tokens") is not None:
        b = th["budget_tokens"]
        _need(isinstance(b, int) and not isinstance(b, bool) and b >= 1,
              "'thinking.budget_tokens' must be a positive integer", "thinking.budget_tokens")


def tool_choice(v: Any, names: list[str], family: str) -> str:
    """Normalised tool choice: 'auto', 'none', 'required' or 'name:<tool>'.

    What each does here (the engine has no grammar-constrained decoding): 'none' renders the
    prompt without tools, so the model answers in text; 'auto', 'required' (Anthropic 'any') and
    a named tool render the tools as given and parse calls the model makes, but cannot force a
    call. A named tool must be one of `tools`."""
    if v is None:
        return "auto"
    if not names:  # as both APIs: forcing a tool call needs tools to call
        forced = v in ("required", "any") or (isinstance(v, dict) and v.get("type") in (
            "any", "tool", "function"))
        _need(not forced, "'tool_choice' forces a tool call but 'tools' is empty", "tool_choice")
    if family == "openai":
        if isinstance(v, str):
            _need(
                v in ("auto", "none", "required"),
                f"'tool_choice' must be 'auto', 'none', 'required' or a named function, got {v!r}",
                "tool_choice",
            )
            return v
        _need(isinstance(v, dict) and v.get("type") == "function"
              and isinstance(v.get("function"), dict), "'tool_choice' must be a string or "
              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        name = v["function"].get("name")
    else:
        _need(isinstance(v, dict) and v.get("type") in ("auto", "any", "tool", "none"),
              "'tool_choice.type' must be one of 'auto', 'any', 'tool', 'none'", "tool_choice")
        if v["type"] != "tool":
            return {"any": "required"}.get(v["type"], v["type"])
        name = v.get("name")
    _need(isinstance(name, str) and name in names,
          f"tool_choice names a tool that is not in 'tools': {name!r}", "tool_choice")
    return "name:" + name
