"""The harmony chat format (gpt-oss): rendering a conversation into a prompt.

What gpt-oss's official chat template (`chat_template.jinja` of the released checkpoints, which
transformers renders) writes, in Python, so that the format holds without the checkpoint's
tokenizer files (o200k_harmony is a download) and so that the cases the template refuses or
loses are rendered (below). Every message is
`<|start|>{header}<|message|>{content}{<|end|> | <|call|> | <|return|>}`:

- a system message: the model identity, `Knowledge cutoff: 2024-06`, `Current date:
  YYYY-MM-DD`, `Reasoning: low|medium|high`, the valid channels, and with tools the line that
  sends `functions` calls to the commentary channel;
- a developer message when the conversation starts with a system (or developer) message or
  has tools: `# Instructions\\n\\n{text}\\n\\n` and `# Tools\\n\\n## functions\\n\\nnamespace
  functions {...} // namespace functions`, each tool a TypeScript-like `type NAME = (_: {...})
  => any;` with its description and its parameters' descriptions as `//` comments;
- user turns; assistant turns as `final` messages (`<|end|>`, or `<|return|>` for a last
  assistant turn without a generation prompt, with its analysis before it);
- an assistant tool call: its reasoning (or, without reasoning, its text) as an `analysis`
  message unless a later assistant turn answers finally (the analysis of earlier turns is
  dropped, as the model was trained), then `<|start|>assistant to=functions.NAME<|channel|>
  commentary json<|message|>{arguments JSON}<|call|>`;
- a tool result: `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>{the
  result as a JSON string}<|end|>`;
- the generation prompt `<|start|>assistant`.

Where the official template refuses or drops input, we render it instead (each noted where it
happens): several tool calls in one message (the template renders the first only) become one
call message each, a tool result names the call it answers by `tool_call_id` (the template: the
latest call); an assistant message with reasoning, text and tool calls (the template refuses)
renders its text as a `commentary` preamble after the analysis; a system or developer message
after the first (the template drops it) is a developer message in place; a tool without a
description (the template fails on it) has no comment line; a non-string enum default is
written with `str`. The browser / python built-in tools are not offered (no API asks for them).

Input: messages in the template-input shape (`freetoken.chat.mapping`: OpenAI-style, `thinking`
/ `reasoning_content`, `tool_calls` with dict arguments) and OpenAI-style function tools.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from freetoken.chat.errors import ChatInputError

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
EFFORTS = ("low", "medium", "high")
_CHANNEL_TAGS = ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>")
_OBJ_INDENT = "\n" + " " * 16  # the template's layout inside a nested object's properties
_DEFAULT_INDENT = " " * 16 + " " * 4  # ... before a oneOf variant's default comment


def _dump(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)  # the template's tojson


def _is_list(t: Any) -> bool:
    return isinstance(t, (list, tuple)) and len(t) > 0


def ts_type(spec: Any) -> str:
    """A JSON-schema property as the template's TypeScript-like type (its macro
    `render_typescript_type`, whitespace included)."""
    if not isinstance(spec, dict):
        return "any"
    t = spec.get("type")
    if t == "array":
        items = spec.get("items")
        if items:
            it = items.get("type") if isinstance(items, dict) else None
            simple = {"string": "string[]", "number": "number[]", "integer": "number[]",
                      "boolean": "boolean[]"}
            if it in simple:
                out = simple[it]
            else:
                inner = ts_type(items)
                out = "any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]"
        else:
            out = "any[]"
        return out + (" | null" if spec.get("nullable") else "")
    if _is_list(t):
        return " | ".join(str(x) for x in t) if len(t) > 1 else str(t[0])
    if spec.get("oneOf"):
        # the template's object-variant test never fires (a `set` inside a loop does not
        # leave it), so every variant is written
        parts = []
        variants = spec["oneOf"]
        for i, v in enumerate(variants):
            s = ts_type(v)
            if isinstance(v, dict) and v.get("description"):
                s += "// " + str(v["description"])
            if isinstance(v, dict) and "default" in v:
                s += _DEFAULT_INDENT + "// default: " + _dump(v["default"])
            if i < len(variants) - 1:
                s += " | \n"
            parts.append(s)
        return "".join(parts)
    if t == "string":
        if spec.get("enum"):
            return '"' + '" | "'.join(str(e) for e in spec["enum"]) + '"'
        return "string" + (" | null" if spec.get("nullable") else "")
    if t in ("number", "integer"):
        return "number"
    if t == "boolean":
        return "boolean"
    if t == "object":
        props = spec.get("properties")
        if not props or not isinstance(props, dict):
            return "object"
        req = spec.get("required") or []
        fields = [name + ("" if name in req else "?") + ": " + _OBJ_INDENT + ts_type(p)
                  for name, p in props.items()]
        return "{\n" + ", ".join(fields) + "}"
    return "any"


def tool_namespace(tools: Sequence[dict[str, Any]]) -> str:
    """`## functions` ... `} // namespace functions` (the template's `render_tool_namespace`)."""
    out = ["## functions\n\n", "namespace functions {\n\n"]
    for t in tools:
        fn = t.get("function", t)
        if fn.get("description") is not None:  # the template fails without one
            out.append("// " + str(fn["description"]) + "\n")
        out.append("type " + str(fn["name"]) + " = ")
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if not props or not isinstance(props, dict):
            out.append("() => any;\n\n")
            continue
        req = params.get("required") or []
        out.append("(_: {\n")
        for name, spec in props.items():
            spec = spec if isinstance(spec, dict) else {}
            if spec.get("description"):
                out.append("// " + str(spec["description"]) + "\n")
            out.append(name + ("" if name in req else "?") + ": " + ts_type(spec))
            if "default" in spec:
                d = spec["default"]
                if spec.get("enum"):
                    out.append(", // default: " + str(d))  # the template: str + default
                elif spec.get("oneOf"):
                    out.append("// default: " + str(d))
                else:
                    out.append(", // default: " + _dump(d))
            out.append(",\n")
        out.append("}) => any;\n\n")
    out.append("} // namespace functions")
    return "".join(out)


def tool_def_lines(text: str, tools: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """(name, offset of the newline before its block) of each tool in the rendered `functions`
    namespace of `text`, in order: a block is the tool's `// description` line (when it has one)
    and its `type NAME = ...` declaration; blocks are separated by a blank line. A tool not
    found ends the list."""
    at = text.find("namespace functions {\n\n")
    out: list[tuple[str, int]] = []
    if at < 0:
        return out
    for t in tools:
        fn = t.get("function", t)
        name = str(fn.get("name"))
        i = text.find("\ntype " + name + " = ", at)
        if i < 0:
            break
        start = i + 1
        if fn.get("description") is not None:
            desc = "// " + str(fn["description"]) + "\n"
            if text[start - len(desc):start] != desc:
                break
            start -= len(desc)
        out.append((name, start - 1))
        at = i + 1
    return out


@dataclass(frozen=True)
class HarmonyOptions:
    """The template's kwargs: `reasoning_effort` (default medium), `model_identity`, and the
    date it writes (`strftime_now("%Y-%m-%d")`: today, local time, unless given)."""

    reasoning_effort: str | None = None
    model_identity: str | None = None
    date: str | None = None


def system_message(tools: bool, opts: HarmonyOptions) -> str:
    effort = opts.reasoning_effort or "medium"
    date = opts.date or datetime.now().strftime("%Y-%m-%d")
    text = ((opts.model_identity if opts.model_identity is not None else IDENTITY) + "\n"
            "Knowledge cutoff: 2024-06\n" f"Current date: {date}\n\n" f"Reasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every "
            "message.")
    if tools:
        text += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return "<|start|>system<|message|>" + text + "<|end|>"


def _check_tags(m: dict[str, Any], i: int) -> None:
    for key in ("content", "thinking"):
        v = m.get(key)
        if isinstance(v, str) and any(tag in v for tag in _CHANNEL_TAGS):
            raise ChatInputError(
                f"messages[{i}].{key} holds harmony channel tags; pass the analysis text as the "
                "reasoning and the final text as the content", f"messages[{i}].{key}")


def _text(v: Any, param: str) -> str:
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ChatInputError(f"'{param}' must be a string", param)
    return v


def _calls(m: dict[str, Any]) -> list[tuple[str | None, str, Any, str]]:
    """(id, name, arguments, content type) of each call of an assistant message."""
    out = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or c
        out.append((c.get("id"), str(fn.get("name")), fn.get("arguments", {}),
                    str(fn.get("content_type", "json"))))
    return out


def render_harmony(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   add_generation_prompt: bool = True,
                   opts: HarmonyOptions | None = None) -> str:
    """The prompt text of `messages` (module docstring). Raises ChatInputError on channel tags
    in a message's text, a tool result before any tool call, or a non-string text."""
    opts = opts or HarmonyOptions()
    if opts.reasoning_effort is not None and opts.reasoning_effort not in EFFORTS:
        raise ChatInputError(f"reasoning effort must be one of {list(EFFORTS)}, got "
                             f"{opts.reasoning_effort!r}", "reasoning_effort")
    out = [system_message(bool(tools), opts)]
    msgs = list(messages)
    dev = ""
    if msgs and msgs[0].get("role") in ("system", "developer"):
        dev = _text(msgs[0].get("content"), "messages[0].content")
        msgs, first = msgs[1:], 1
    else:
        first = 0
    if dev or tools:
        body = ("# Instructions\n\n" + dev + "\n\n" if dev else "")
        body += ("# Tools\n\n" + tool_namespace(tools) if tools else "")
        out.append("<|start|>developer<|message|>" + body + "<|end|>")
    names: dict[str, str] = {}  # tool_call_id -> function name
    last: str | None = None
    for j, m in enumerate(msgs):
        i, role = j + first, m.get("role")
        content = _text(m.get("content"), f"messages[{i}].content")
        if role == "assistant":
            _check_tags(m, i)
            thinking = m.get("thinking", m.get("reasoning_content"))
            calls = _calls(m)
            if calls:
                final_later = any(f.get("role") == "assistant" and not f.get("tool_calls")
                                  for f in msgs[j + 1:])
                if not final_later:
                    if content and thinking:  # the template refuses: text as a preamble
                        out.append("<|start|>assistant<|channel|>analysis<|message|>"
                                   + thinking + "<|end|>")
                        out.append("<|start|>assistant<|channel|>commentary<|message|>"
                                   + content + "<|end|>")
                    elif content or thinking:
                        out.append("<|start|>assistant<|channel|>analysis<|message|>"
                                   + (content or thinking) + "<|end|>")
                for cid, name, args, ctype in calls:  # the template: the first call only
                    out.append(f"<|start|>assistant to=functions.{name}<|channel|>commentary "
                               f"{ctype}<|message|>{_dump(args)}<|call|>")
                    if cid is not None:
                        names[cid] = name
                    last = name
            elif j == len(msgs) - 1 and not add_generation_prompt:
                if thinking is not None:
                    out.append("<|start|>assistant<|channel|>analysis<|message|>" + thinking
                               + "<|end|>")
                out.append("<|start|>assistant<|channel|>final<|message|>" + content
                           + "<|return|>")
            else:
                out.append("<|start|>assistant<|channel|>final<|message|>" + content + "<|end|>")
                last = None
        elif role == "tool":
            name = names.get(m.get("tool_call_id"), last)  # type: ignore[arg-type]
            if name is None:
                raise ChatInputError(f"messages[{i}] is a tool result, but no earlier assistant "
                                     "message made a tool call", f"messages[{i}]")
            out.append(f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"
                       + _dump(content) + "<|end|>")
        elif role == "user":
            out.append("<|start|>user<|message|>" + content + "<|end|>")
        elif role in ("system", "developer"):  # the template drops it: a developer message
            out.append("<|start|>developer<|message|>" + content + "<|end|>")
    if add_generation_prompt:
        out.append("<|start|>assistant")
    return "".join(out)
