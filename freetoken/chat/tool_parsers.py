"""Tool-call body parsers: the text between a family's call tags (`CALL_TAGS`).

- JSON (Qwen3, Qwen2.5): `{"name": "f", "arguments": {...}}`.
- XML (Qwen3-Coder, Qwen3.5/3.6): `<function=f>\n<parameter=k>\nvalue\n</parameter>\n</function>`.
  Values follow the tool schema's type when known (a `string` parameter stays text even when it
  looks like a number); otherwise a value that parses as JSON becomes that JSON value, else text.
- GLM (GLM-4.5 to GLM-5, inside `<tool_call>`): `f<arg_key>k</arg_key><arg_value>v</arg_value>...`
  (GLM-4.5 puts newlines between the parts). The template writes string values as they are and
  others as JSON, so values are read back as the XML format's.
- DeepSeek (V3.1, inside `<｜tool▁call▁begin｜>` ... `<｜tool▁call▁end｜>`):
  `f<｜tool▁sep｜>{json}`; V3's older `function<｜tool▁sep｜>f\n```json\n{json}\n```` is read too.
- Kimi (K2 / Kimi-Linear, inside `<|tool_call_begin|>` ... `<|tool_call_end|>`):
  `functions.f:0<|tool_call_argument_begin|>{json}` (the id's `functions.` and `:index` dropped).

Parsers return `(name, arguments_json_text)` or None for a malformed body; they never raise.
"""
from __future__ import annotations

import json
import re
from typing import Any

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>\s*$|$)", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

Schemas = dict[str, dict[str, Any]]  # tool name -> JSON-schema `properties`


def tool_schemas(tools: list[dict[str, Any]] | None) -> Schemas:
    """`{name: properties}` from OpenAI-style function tools (what TemplateInput.tools holds)."""
    out: Schemas = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or fn.get("input_schema") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def offered_name(name: str, offered: Schemas | dict | None) -> tuple[str, str | None]:
    """The request's spelling of a called tool: `name` when the request offered it (or offered
    no tools), else the one offered name equal to it up to case (a model trained on another
    harness's `bash` calling this one's `Bash`). Returns (name, why): why is None when the
    name stands, "case" when it was mapped, "not_offered" when no offered tool matches (the
    call goes out as the model wrote it: the harness answers an unknown tool itself)."""
    if not offered or name in offered:
        return name, None
    same = [n for n in offered if n.lower() == name.lower()]
    if len(same) == 1:
        return same[0], "case"
    return name, "not_offered"


def _dump(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def parse_json_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], _dump(args)


def _types(spec: Any) -> set[str]:
    if not isinstance(spec, dict):
        return set()
    t = spec.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    found: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in spec.get(key) or []:
            found |= _types(sub)
    return found


def _convert(raw: str, spec: Any) -> Any:
    types = _types(spec)
    if types == {"string"}:
        return raw
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        if "boolean" in types and raw.strip() in ("True", "False"):
            return raw.strip() == "True"
        return raw
    if types and "string" in types and not isinstance(value, str):
        # ambiguous schema (e.g. ["string", "null"]): keep text unless it is JSON null
        return None if value is None and "null" in types else raw
    return value


def parse_xml_call(body: str, schemas: Schemas | None = None) -> tuple[str, str] | None:
    m = _FUNCTION.fullmatch(body.strip())
    if m is None:
        return None
    name = m.group(1).strip()
    inner = m.group(2)
    props = (schemas or {}).get(name, {})
    args: dict[str, Any] = {}
    for pm in _PARAM.finditer(inner):
        raw = pm.group(2)
        raw = raw.removeprefix("\n")
        raw = raw.removesuffix("\n")
        key = pm.group(1).strip()
        args[key] = _convert(raw, props.get(key))
    if _PARAM.sub("", inner).strip():
        return None  # stray text between parameters
    return (name, _dump(args)) if name else None


_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
DS_SEP = "<｜tool▁sep｜>"
KIMI_ARGS = "<|tool_call_argument_begin|>"
# family format -> (call open tag, call close tag, section tags the parser drops)
CALL_TAGS = {
    "json": ("<tool_call>", "</tool_call>", ()),
    "xml": ("<tool_call>", "</tool_call>", ()),
    "glm": ("<tool_call>", "</tool_call>", ()),
    "deepseek": ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")),
    "kimi": ("<|tool_call_begin|>", "<|tool_call_end|>",
             ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")),
}


def parse_glm_call(body: str, schemas: Schemas | None = None) -> tuple[str, str] | None:
    s = body.strip()
    cut = s.find("<arg_key>")
    name = (s if cut < 0 else s[:cut]).strip()
    if not name or "<" in name or "\n" in name:
        return None
    props = (schemas or {}).get(name, {})
    args: dict[str, Any] = {}
    pos = len(s) if cut < 0 else cut
    while pos < len(s):
        m = _GLM_ARG.match(s, pos)
        if m is None:
            return None  # stray text or an unclosed pair
        key = m.group(1).strip()
        args[key] = _convert(m.group(2), props.get(key))
        pos = m.end()
        if not s[pos:].strip():
            break
    return name, _dump(args)


def _json_args(text: str) -> str | None:
    try:
        args = json.loads(text) if text.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        return None
    return _dump(args) if isinstance(args, dict) else None


def parse_deepseek_call(body: str) -> tuple[str, str] | None:
    head, sep, rest = body.strip().partition(DS_SEP)
    if not sep:
        return None
    if head.strip() == "function" and "```" in rest:  # V3: type, then name and a json fence
        name, _, fence = rest.partition("\n")
        inner = fence.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
        args = _json_args(inner)
    else:
        name, args = head, _json_args(rest)
    name = name.strip()
    return (name, args) if name and args is not None and "\n" not in name else None


def parse_kimi_call(body: str) -> tuple[str, str] | None:
    head, sep, rest = body.strip().partition(KIMI_ARGS)
    if not sep:
        return None
    name = head.strip().removeprefix("functions.")
    name = name.rsplit(":", 1)[0] if ":" in name else name
    args = _json_args(rest)
    return (name, args) if name and args is not None else None


def parse_tool_call(body: str, default_format: str = "json",
                    schemas: Schemas | None = None) -> tuple[str, str] | None:
    """Parse one call body, picking the format by its first character (`<function=` -> XML,
    `{` -> JSON), else `default_format` ("json" or "xml"); the GLM, DeepSeek and Kimi formats
    are their families' only ones."""
    if default_format == "glm":
        return parse_glm_call(body, schemas)
    if default_format == "deepseek":
        return parse_deepseek_call(body)
    if default_format == "kimi":
        return parse_kimi_call(body)
    s = body.strip()
    if s.startswith("<function="):
        return parse_xml_call(s, schemas)
    if s.startswith("{"):
        return parse_json_call(s)
    return parse_xml_call(s, schemas) if default_format == "xml" else parse_json_call(s)
