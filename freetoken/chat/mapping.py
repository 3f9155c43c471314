"""Shared pieces of the OpenAI and Anthropic request mappings.

Both mappings produce a `TemplateInput`: messages in the shape chat templates expect (OpenAI
style: `role`, string `content`, assistant `tool_calls` with dict `arguments`, assistant
`reasoning_content`, `tool` messages), OpenAI-style function tools, and the thinking switch.
Everything that is not a token (cache_control, signatures, metadata, ids the template does not
print) is dropped here, so equal conversations render to equal prompts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from freetoken.chat.errors import ChatInputError

# Several text parts/blocks of one message are joined with a newline (what vLLM does); a single
# part gives exactly its text, so `"x"` and `[{"type":"text","text":"x"}]` render the same.
TEXT_JOIN = "\n"


@dataclass
class TemplateInput:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    enable_thinking: bool | None


def need_dict(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ChatInputError(f"{param} must be an object", param)
    return value


def need_list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise ChatInputError(f"{param} must be an array", param)
    return value


def need_str(value: Any, param: str, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise ChatInputError(f"{param} must be a string", param)
    if not allow_empty and not value:
        raise ChatInputError(f"{param} must not be empty", param)
    return value


def parse_arguments(value: Any, param: str) -> dict[str, Any]:
    """Tool-call arguments as a dict: a JSON object text (OpenAI) or an object (Anthropic)."""
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ChatInputError(f"{param} is not valid JSON: {e.msg}", param) from e
    if not isinstance(value, dict):
        raise ChatInputError(f"{param} must be a JSON object", param)
    return value


def function_tool(
    name: Any, description: Any, parameters: Any, param: str
) -> dict[str, Any]:
    """An OpenAI-style function tool (the shape the Qwen templates print with `tojson`)."""
    need_str(name, f"{param}.name", allow_empty=False)
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = need_str(description, f"{param}.description")
    if parameters is not None:
        fn["parameters"] = need_dict(parameters, f"{param}.parameters")
    return {"type": "function", "function": fn}


def tool_call(call_id: Any, name: Any, arguments: dict[str, Any], param: str) -> dict[str, Any]:
    need_str(name, f"{param}.name", allow_empty=False)
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call_id, str):
        call["id"] = call_id
    return call


def thinking_from_bool(value: Any, param: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ChatInputError(f"{param} must be a boolean", param)
