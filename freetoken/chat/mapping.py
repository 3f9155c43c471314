"""Shared pieces of the OpenAI and Anthropic request walks.

Each API has one walk over its request body (`openai_request`, `anthropic_request`) that checks
and maps in the same pass and returns a `ChatRequest`: the `TemplateInput` (messages in the
shape chat templates expect — OpenAI style: `role`, string `content`, assistant `tool_calls` with
dict `arguments`, assistant `reasoning_content`, `tool` messages —, OpenAI-style function tools,
the thinking switch) and the normalised tool choice. Everything that is not a token
(cache_control, signatures, metadata, ids the template does not print) is dropped, so equal
conversations render to equal prompts. Errors are `ChatInputError`s naming the field in one
path style for both APIs (`messages[3].content[1].type`); the server answers them as 400s.

Two kinds of rule, one walk: what rendering needs (always checked) and the API's own typing
rules that rendering does not need (`Checks.strict`, the server: tool names without whitespace,
JSON-Schema tool parameters, unique tool names, every tool result answering an earlier call,
`tool_choice`). Tools that map a recorded body without serving it (the proxy's session view,
`ft bench anchors`) walk without them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from freetoken.chat import json_limits
from freetoken.chat.errors import ChatInputError

# Several text parts/blocks of one message are joined with a newline (what vLLM does); a single
# part gives exactly its text, so `"x"` and `[{"type":"text","text":"x"}]` render the same.
TEXT_JOIN = "\n"
MAX_NAME = 256
MAX_MESSAGE = 300  # error messages that quote client values are cut here


@dataclass
class TemplateInput:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    enable_thinking: bool | None
    reasoning_effort: str | None = None  # 'low' | 'medium' | 'high' (harmony's levels) or None


def effort_level(v: Any, param: str) -> str | None:
    """A requested reasoning effort as harmony's level (gpt-oss's system message): low, medium
    and high as they are, 'none' / 'minimal' -> low, 'xhigh' / 'max' / 'ultra' -> high; None when
    absent or another level (the other families read only whether it is 'none')."""
    if v is None:
        return None
    v = need_str(v, param)
    level = {"none": "low", "minimal": "low", "xhigh": "high", "max": "high",
             "ultra": "high"}.get(v, v)
    return level if level in ("low", "medium", "high") else None


@dataclass
class ChatRequest:
    """A validated chat request. `tool_choice`: 'auto', 'none', 'required' or 'name:<tool>'
    ('auto' when not checked, i.e. outside `strict`)."""

    template: TemplateInput
    tool_choice: str = "auto"

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt renders: none under tool_choice 'none', so the model answers
        in text (there is no grammar-constrained decoding to force or forbid a call)."""
        return None if self.tool_choice == "none" else self.template.tools


def fail(msg: str, param: str) -> NoReturn:
    raise ChatInputError(msg[:MAX_MESSAGE], param)


def need(cond: Any, msg: str, param: str) -> None:
    """For rules checked once per body; per message and per block the walks test first and
    call `fail`, so no error text is formatted for a field that passes."""
    if not cond:
        fail(msg, param)


class Checks:
    """State of one body walk: whether the API's own rules apply, and the tool-call ids seen so
    far (a tool result must answer one of an earlier message, as both APIs require)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.call_ids: set[str] = set()

    def api(self, cond: Any, msg: str, param: str) -> None:
        """A rule of the API that rendering does not need: checked only when strict."""
        if self.strict:
            need(cond, msg, param)


def need_dict(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail(f"'{param}' must be an object", param)
    return value


def need_list(value: Any, param: str, what: str = "an array") -> list[Any]:
    if not isinstance(value, list):
        fail(f"'{param}' must be {what}", param)
    return value


def need_str(value: Any, param: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        fail(f"'{param}' must be a string", param)
    if not (allow_empty or value):
        fail(f"'{param}' must not be empty", param)
    return value


def opt_str(d: dict[str, Any], key: str, param: str) -> None:
    v = d.get(key)
    if not (v is None or isinstance(v, str)):
        fail(f"'{param}.{key}' must be a string", f"{param}.{key}")


def messages_list(body: dict[str, Any]) -> list[Any]:
    msgs = body.get("messages")
    need(isinstance(msgs, list) and msgs, "'messages' must be a non-empty array", "messages")
    return msgs


def check_name(name: Any, param: str) -> str:
    """A tool name as both APIs type it (strict); outside strict any non-empty string."""
    ok = (isinstance(name, str) and 0 < len(name) <= MAX_NAME
          and not any(c.isspace() or ord(c) < 32 for c in name))
    if not ok:
        fail(f"'{param}' must be a non-empty name without whitespace (at most {MAX_NAME} "
             "chars)", param)
    return name


def tool_name(name: Any, param: str, ck: Checks) -> str:
    return check_name(name, param) if ck.strict else need_str(name, param, allow_empty=False)


def check_schema(schema: Any, param: str) -> None:
    """A tool's parameter schema: a JSON-Schema object describing an object."""
    need_dict(schema, param)
    t = schema.get("type")
    need(t is None or t == "object" or (isinstance(t, list) and "object" in t),
         f"'{param}' must be a JSON Schema of type 'object', got type {t!r}", param)
    props = schema.get("properties")
    need(props is None or (isinstance(props, dict) and all(isinstance(v, (dict, bool))
                                                           for v in props.values())),
         f"'{param}.properties' must map property names to schemas", param + ".properties")
    req = schema.get("required")
    need(req is None or (isinstance(req, list) and all(isinstance(r, str) for r in req)),
         f"'{param}.required' must be an array of strings", param + ".required")


def function_tool(name: str, description: Any, schema: Any, param: str, schema_param: str,
                  ck: Checks) -> dict[str, Any]:
    """An OpenAI-style function tool (the shape the Qwen templates print with `tojson`);
    `param` is the object holding `description`, `schema_param` the schema's own path."""
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = need_str(description, f"{param}.description")
    if schema is not None:
        check_schema(schema, schema_param) if ck.strict else need_dict(schema, schema_param)
        fn["parameters"] = schema
    return {"type": "function", "function": fn}


def unique_tools(tools: list[dict[str, Any]], param: str, ck: Checks) -> None:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        n = t["function"]["name"]
        if ck.strict and n in seen:
            fail(f"tool names must be unique; {n!r} appears twice", param.format(i))
        seen.add(n)


def parse_arguments(value: Any, param: str) -> dict[str, Any]:
    """Tool-call arguments as a dict: a JSON object text (OpenAI) or an object (Anthropic).
    The text is held to the body's own limits (`json_limits`: depth, integer size, lone
    surrogates)."""
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json_limits.loads(value)
        except json_limits.JSONLimitError as e:
            raise ChatInputError(f"'{param}' is {e}" if str(e).startswith("not ")
                                 else f"'{param}' is not accepted: {e}", param) from None
    need(isinstance(value, dict), f"'{param}' must be a JSON object", param)
    return value


def tool_call(call_id: Any, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call_id, str):
        call["id"] = call_id
    return call


def tool_choice(v: Any, tools: list[dict[str, Any]] | None, family: str) -> str:
    """Normalised tool choice: 'auto', 'none', 'required' or 'name:<tool>'.

    What each does here (the engine has no grammar-constrained decoding): 'none' renders the
    prompt without tools, so the model answers in text; 'auto', 'required' (Anthropic 'any') and
    a named tool render the tools as given and parse calls the model makes, but cannot force a
    call. A named tool must be one of `tools`."""
    if v is None:
        return "auto"
    names = [t["function"]["name"] for t in tools or ()]
    if not names:  # as both APIs: forcing a tool call needs tools to call
        forced = v in ("required", "any") or (isinstance(v, dict) and v.get("type") in (
            "any", "tool", "function"))
        need(not forced, "'tool_choice' forces a tool call but 'tools' is empty", "tool_choice")
    if family == "openai":
        if isinstance(v, str):
            need(v in ("auto", "none", "required"), "'tool_choice' must be 'auto', 'none', "
                 f"'required' or a named function, got {v!r}", "tool_choice")
            return v
        need(isinstance(v, dict) and v.get("type") == "function"
             and isinstance(v.get("function"), dict), "'tool_choice' must be a string or "
             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        name = v["function"].get("name")
    else:
        need(isinstance(v, dict) and v.get("type") in ("auto", "any", "tool", "none"),
             "'tool_choice.type' must be one of 'auto', 'any', 'tool', 'none'", "tool_choice")
        if v["type"] != "tool":
            return {"any": "required"}.get(v["type"], v["type"])
        name = v.get("name")
    need(isinstance(name, str) and name in names,
         f"tool_choice names a tool that is not in 'tools': {name!r}", "tool_choice")
    return "name:" + name
