"""JSON-Schema checks of tool calls against a request's tool list, for the keywords the
harnesses' tool parameters use: the oracle that the demo model's training data
(freetoken/models/demo_data.py) and its replies call only real tools with valid arguments."""
from __future__ import annotations

from typing import Any

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),)}


def schema_errors(schema: dict[str, Any], value: Any, where: str = "$") -> list[str]:
    """What of `value` breaks `schema`, for the JSON-Schema keywords the harnesses' tool
    parameters use (type, properties, required, additionalProperties, enum, const, items,
    anyOf); other keywords are not checked."""
    errs: list[str] = []
    if "anyOf" in schema and all(schema_errors(s, value, where) for s in schema["anyOf"]):
        errs.append(f"{where}: matches none of anyOf")
    t = schema.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        ok = any(isinstance(value, _JSON_TYPES[x]) and not (
            x in ("integer", "number") and isinstance(value, bool)) for x in types)
        if not ok:
            return [*errs, f"{where}: {type(value).__name__} is not {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{where}: {value!r} not in enum")
    if "const" in schema and value != schema["const"]:
        errs.append(f"{where}: {value!r} is not the const")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        errs += [f"{where}: missing required {k!r}" for k in schema.get("required") or []
                 if k not in value]
        for k, v in value.items():
            if k in props:
                errs += schema_errors(props[k], v, f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{where}: unexpected {k!r}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errs += schema_errors(schema["items"], v, f"{where}[{i}]")
    return errs


def tool_call_errors(tools: list[dict[str, Any]] | None, name: str,
                     arguments: dict[str, Any]) -> list[str]:
    """Why a call of `name` with `arguments` is not valid for the request's `tools` (OpenAI
    function tools, as `TemplateInput.tools` holds them); [] when it is."""
    for t in tools or []:
        fn = t.get("function", t)
        if fn.get("name") == name:
            return schema_errors(fn.get("parameters") or {"type": "object"}, arguments)
    return [f"{name!r} is not one of the request's tools"]
