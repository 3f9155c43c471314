"""Translate a request body between the Anthropic Messages and OpenAI chat shapes.

Used when a workload is replayed on the surface it was not recorded on (`--api`). The mapping
keeps every token the model would see: system blocks become one system message (and back),
thinking <-> `reasoning_content`, tool_use <-> `tool_calls`, tool_result blocks <-> `tool`
messages, tool schemas <-> functions. Anthropic-only metadata (`cache_control`, `metadata`,
`thinking`, `context_management`, `output_config`) has no OpenAI counterpart and is dropped.
"""
from __future__ import annotations

import json
from typing import Any

_ANTHROPIC_ONLY = ("system", "messages", "tools", "metadata", "thinking", "context_management",
                   "output_config", "tool_choice", "max_tokens")
_OPENAI_ONLY = ("messages", "tools", "stream_options", "tool_choice", "max_tokens",
                "max_completion_tokens")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if b.get("type") == "text")


def anthropic_to_openai(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _ANTHROPIC_ONLY}
    msgs: list[dict[str, Any]] = []
    if body.get("system"):
        msgs.append({"role": "system", "content": _text(body["system"])})
    for m in body["messages"]:
        c = m["content"]
        if m["role"] == "system" or isinstance(c, str):
            msgs.append({"role": m["role"], "content": _text(c)})
        elif m["role"] == "assistant":
            a: dict[str, Any] = {"role": "assistant", "content": _text(c) or None}
            think = "".join(b["thinking"] for b in c if b["type"] == "thinking")
            if think:
                a["reasoning_content"] = think
            calls = [{"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"], separators=(",", ":"),
                                                           ensure_ascii=False)}}
                for b in c if b["type"] == "tool_use"]
            if calls:
                a["tool_calls"] = calls
            msgs.append(a)
        else:
            for b in c:
                if b["type"] == "tool_result":
                    msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                 "content": _text(b["content"])})
            text = [b for b in c if b["type"] == "text"]
            if text:
                msgs.append({"role": "user", "content": _text(text)})
    out["messages"] = msgs
    if body.get("tools"):
        out["tools"] = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t["input_schema"]}} for t in body["tools"]]
        out["tool_choice"] = "auto"
    out["max_tokens"] = body.get("max_tokens")
    out["stream_options"] = {"include_usage": True}
    return out


def openai_to_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _OPENAI_ONLY}
    src = body["messages"]
    lead = 0
    system: list[dict[str, Any]] = []
    while lead < len(src) and src[lead]["role"] == "system":
        system.append({"type": "text", "text": _text(src[lead]["content"])})
        lead += 1
    msgs: list[dict[str, Any]] = []
    for m in src[lead:]:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"],
                     "content": _text(m["content"])}
            if msgs and msgs[-1]["role"] == "user" and isinstance(msgs[-1]["content"], list) \
                    and msgs[-1]["content"][-1]["type"] == "tool_result":
                msgs[-1]["content"].append(block)
            else:
                msgs.append({"role": "user", "content": [block]})
        elif m["role"] == "assistant":
            blocks: list[dict[str, Any]] = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"],
                               "signature": ""})
            if m.get("content"):
                blocks.append({"type": "text", "text": _text(m["content"])})
            for c in m.get("tool_calls") or []:
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                               "input": json.loads(c["function"]["arguments"] or "{}")})
            msgs.append({"role": "assistant", "content": blocks})
        else:
            msgs.append({"role": m["role"], "content": m["content"]})
    if system:
        out["system"] = system
    out["messages"] = msgs
    if body.get("tools"):
        out["tools"] = [{"name": t["function"]["name"],
                         "description": t["function"].get("description", ""),
                         "input_schema": t["function"]["parameters"]} for t in body["tools"]]
    out["max_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens") or 4096
    return out


def to_api(body: dict[str, Any], src: str, dst: str) -> dict[str, Any]:
    """`body` (recorded in `src` shape) in `dst` shape; the same object when they agree."""
    if src == dst:
        return body
    return anthropic_to_openai(body) if src == "anthropic" else openai_to_anthropic(body)
