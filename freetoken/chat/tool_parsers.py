"""Tool-call body parsers for the Qwen formats (the text between `<tool_call>` and
`</tool_call>`).

- JSON (Qwen3, Qwen2.5): `{"name": "f", "arguments": {...}}`.
- XML (Qwen3-Coder, Qwen3.5/3.6): `<function=f>\n<parameter=k>\nvalue\n</parameter>\n</function>`.
  Values follow the tool schema's type when known (a `string` parameter stays text even when it
  looks like a number); otherwise a value that parses as JSON becomes that JSON value, else text.

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


def parse_tool_call(body: str, default_format: str = "json",
                    schemas: Schemas | None = None) -> tuple[str, str] | None:
    """Parse one call body, picking the format by its first character (`<function=` -> XML,
    `{` -> JSON), else `default_format` ("json" or "xml")."""
    s = body.strip()
    if s.startswith("<function="):
        return parse_xml_call(s, schemas)
    if s.startswith("{"):
        return parse_json_call(s)
    return parse_xml_call(s, schemas) if default_format == "xml" else parse_json_call(s)
