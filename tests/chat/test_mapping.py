"""OpenAI and Anthropic request mapping: every recorded harness body maps and renders; invalid
bodies raise ChatInputError naming the field; the two APIs agree on equivalent conversations."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from freetoken.chat import (
    ChatInputError,
    ChatTokenizer,
    TemplateInput,
    anthropic_to_template,
    openai_to_template,
)


def test_every_trace_request_maps_and_renders(tok: ChatTokenizer, trace_reqs: list) -> None:
    for name, rec in trace_reqs:
        body = rec["body"]
        anth = rec["path"].startswith("/v1/messages")
        ti = anthropic_to_template(body) if anth else openai_to_template(body)
        p = tok.render(ti.messages, ti.tools, ti.enable_thinking, keep_all_reasoning=True)
        assert p.endswith(("<|im_start|>assistant\n", "<think>\n\n</think>\n\n")), name
        assert "x-anthropic-billing-header" not in p, name
        assert "cache_control" not in p and "stubsig_" not in p, name
        if anth and body.get("thinking", {}).get("type") == "adaptive":
            assert ti.enable_thinking is True


def test_cache_control_and_content_shape_do_not_change_the_prompt(trace_reqs: list) -> None:
    body = next(r["body"] for n, r in trace_reqs if n.startswith("cc_try1"))
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "cache_control"}
        return [strip(v) for v in x] if isinstance(x, list) else x

    stripped = strip(body)
    assert stripped != body
    assert anthropic_to_template(stripped) == anthropic_to_template(body)
    oa = {"messages": [{"role": "user", "content": "hi"}]}
    ob = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert openai_to_template(oa) == openai_to_template(ob)


OPENAI_CONV: dict[str, Any] = {
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning": "think",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "bash", "arguments": "{\"cmd\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "out"},
        {"role": "assistant", "content": "done"},
    ],
    "tools": [{"type": "function", "function": {"name": "bash", "description": "d",
                                                "parameters": {"type": "object"}}}],
    "reasoning_effort": "high",
}
ANTHROPIC_CONV: dict[str, Any] = {
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"},
               {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "think", "signature": "sig"},
            {"type": "redacted_thinking", "data": "zzz"},
            {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "out"}],
                                      "is_error": False}]},
        {"role": "assistant", "content": "done"},
    ],
    "tools": [{"name": "bash", "description": "d", "input_schema": {"type": "object"},
               "cache_control": {"type": "ephemeral"}}],
    "thinking": {"type": "enabled", "budget_tokens": 1024},
}
EXPECTED = TemplateInput(
    messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "reasoning_content": "think",
         "tool_calls": [{"type": "function", "id": "t1",
                         "function": {"name": "bash", "arguments": {"cmd": "ls"}}}]},
        {"role": "tool", "content": "out", "tool_call_id": "t1"},
        {"role": "assistant", "content": "done"},
    ],
    tools=[{"type": "function", "function": {"name": "bash", "description": "d",
                                             "parameters": {"type": "object"}}}],
    enable_thinking=True,
)


def test_openai_and_anthropic_map_the_same_conversation() -> None:
    # the OpenAI body asks for an effort level too (gpt-oss's system message reads it)
    assert openai_to_template(OPENAI_CONV) == dataclasses.replace(EXPECTED,
                                                                  reasoning_effort="high")
    assert anthropic_to_template(ANTHROPIC_CONV) == EXPECTED


@pytest.mark.parametrize("extra,want", [
    ({}, None), ({"reasoning_effort": "none"}, False), ({"reasoning_effort": "low"}, True),
    ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"}, False),
])
def test_openai_thinking_switch(extra: dict[str, Any], want: bool | None) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    assert openai_to_template(body).enable_thinking is want


@pytest.mark.parametrize("thinking,want", [
    (None, None), ({"type": "adaptive"}, True), ({"type": "disabled"}, False)])
def test_anthropic_thinking_switch(thinking: Any, want: bool | None) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
    if thinking is not None:
        body["thinking"] = thinking
    assert anthropic_to_template(body).enable_thinking is want


def _openai_bad(path: str, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(OPENAI_CONV)
    *keys, last = path.split(".")
    node: Any = body
    for k in keys:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return body


@pytest.mark.parametrize("path,value,param", [
    ("messages.1.role", "wizard", "messages[1].role"),
    ("messages.1.content", [{"type": "image_url", "image_url": {"url": "x"}}],
     "messages[1].content[0].type"),
    ("messages.1.content", 7, "messages[1].content"),
    ("messages.3.content", None, "messages[3].content"),
    ("messages.2.tool_calls.0.function.arguments", "{not json",
     "messages[2].tool_calls[0].function.arguments"),
    ("messages.2.tool_calls.0.function.arguments", "[1, 2]",
     "messages[2].tool_calls[0].function.arguments"),
    ("messages.2.tool_calls.0.function.name", "", "messages[2].tool_calls[0].function.name"),
    ("tools.0.function", {"description": "no name"}, "tools[0].function.name"),
    ("tools.0.type", "retrieval", "tools[0].type"),
    ("tools.0.function.parameters", "object", "tools[0].function.parameters"),
    ("messages", [], "messages"),
    ("messages.0", "hello", "messages[0]"),
    ("reasoning_effort", 3, "reasoning_effort"),
])
def test_openai_invalid(path: str, value: Any, param: str) -> None:
    with pytest.raises(ChatInputError) as e:
        openai_to_template(_openai_bad(path, value))
    assert e.value.param == param
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("mutate,param", [
    (lambda b: b["messages"][0]["content"].append({"type": "image", "source": {}}),
     "messages[0].content[2].type"),
    (lambda b: b["messages"][2]["content"][0].update(content=[{"type": "image"}]),
     "messages[2].content[0].content[0].type"),
    (lambda b: b["messages"][1]["content"][2].update(input="{bad"), "messages[1].content[2].input"),
    (lambda b: b["messages"][1]["content"][2].pop("name"), "messages[1].content[2].name"),
    (lambda b: b["tools"][0].pop("name"), "tools[0].name"),
    (lambda b: b["tools"][0].pop("input_schema"), "tools[0].input_schema"),
    (lambda b: b["tools"].append({"type": "web_search_20250305", "name": "ws"}), "tools[1].type"),
    (lambda b: b.update(thinking={"type": "sometimes"}), "thinking.type"),
    (lambda b: b.update(system=[{"type": "image"}]), "system[0].type"),
    (lambda b: b["messages"][0].update(role="tool"), "messages[0].role"),
    (lambda b: b["messages"][0].pop("content"), "messages[0].content"),
    (lambda b: b["messages"][2]["content"][0].pop("tool_use_id"),
     "messages[2].content[0].tool_use_id"),
])
def test_anthropic_invalid(mutate: Any, param: str) -> None:
    body = copy.deepcopy(ANTHROPIC_CONV)
    mutate(body)
    with pytest.raises(ChatInputError) as e:
        anthropic_to_template(body)
    assert e.value.param == param


def test_anthropic_block_order_and_system_messages() -> None:
    body = {"system": "S", "messages": [
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "r1"},
            {"type": "text", "text": "t1"}, {"type": "text", "text": "t2"},
            {"type": "tool_result", "tool_use_id": "b"}]},
        {"role": "system", "content": "note"}]}
    ti = anthropic_to_template(body)
    assert ti.messages == [
        {"role": "system", "content": "S"},
        {"role": "tool", "content": "r1", "tool_call_id": "a"},
        {"role": "user", "content": "t1\nt2"},
        {"role": "tool", "content": "", "tool_call_id": "b"},
        {"role": "system", "content": "note"}]
    assert ti.tools is None and ti.enable_thinking is None
