"""The one walk per API (`openai_request`, `anthropic_request`): strict (the server) and lenient
(the proxy's session view, bench tools) modes of the same walk agree on every mapping and on
what rendering needs, and differ exactly by the API's own rules; typed Anthropic server tools
get one answer in both modes."""
from __future__ import annotations

import copy
from typing import Any

import pytest
from test_mapping import ANTHROPIC_CONV, OPENAI_CONV

from freetoken.chat import (
    ChatInputError,
    anthropic_request,
    anthropic_to_template,
    openai_request,
    openai_to_template,
)


def test_strict_accepts_every_recorded_body_and_maps_it_as_lenient(trace_reqs: list) -> None:
    """Catches a strict rule that refuses what a real harness sends, and the two modes of the
    walk drifting apart in what they render."""
    for name, rec in trace_reqs:
        body = rec["body"]
        if rec["path"].startswith("/v1/messages"):
            strict, lenient = anthropic_request(body), anthropic_to_template(body)
        else:
            strict, lenient = openai_request(body), openai_to_template(body)
        assert strict.template == lenient, name
        assert strict.tool_choice in ("auto", "none", "required") or \
            strict.tool_choice.startswith("name:"), name


TYPED_TOOLS = [
    ({"name": "f", "input_schema": {"type": "object"}}, True),
    ({"type": "custom", "name": "f", "input_schema": {"type": "object"}}, True),
    ({"type": "web_search_20250305", "name": "web_search"}, False),
    ({"type": "bash_20250124", "name": "bash"}, False),
    ({"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}, False),
    ({"type": "web_search_20250305", "name": "ws", "input_schema": {"type": "object"}}, False),
]


@pytest.mark.parametrize("tool,accepted", TYPED_TOOLS)
def test_typed_server_tools_one_answer_in_both_modes(tool: dict, accepted: bool) -> None:
    """Issue 9: the server's validator accepted typed server tools that the mapping refused.
    Both modes now run the same rule; this fails if either starts to differ."""
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    answers = []
    for fn in (anthropic_request, anthropic_to_template):
        try:
            fn(body)
            answers.append(None)
        except ChatInputError as e:
            answers.append(e.param)
    assert answers == ([None, None] if accepted else ["tools[0].type", "tools[0].type"])


def _oa(**extra: Any) -> dict[str, Any]:
    return {**copy.deepcopy(OPENAI_CONV), **extra}


def _an(mutate: Any) -> dict[str, Any]:
    body = copy.deepcopy(ANTHROPIC_CONV)
    mutate(body)
    return body


TOOL = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
# the API's own rules: refused strict (param), mapped lenient
OPENAI_API_RULES = [
    (_oa(tools=[TOOL, TOOL]), "tools[1].function.name"),
    (_oa(tools=[{"type": "function", "function": {"name": "two words"}}]),
     "tools[0].function.name"),
    (_oa(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]), "tools[0].function.parameters"),
    (_oa(messages=[{"role": "user", "content": "x"},
                   {"role": "tool", "tool_call_id": "nope", "content": "r"}]),
     "messages[1].tool_call_id"),
    (_oa(messages=[{"role": "user", "content": "x", "name": 3}]), "messages[0].name"),
    (_oa(tool_choice="always"), "tool_choice"),
    (_oa(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
]
ANTHROPIC_API_RULES = [
    (_an(lambda b: b["tools"].append(copy.deepcopy(b["tools"][0]))), "tools[1].name"),
    (_an(lambda b: b["tools"][0].update(input_schema={"type": "array"})),
     "tools[0].input_schema"),
    (_an(lambda b: b["messages"][2]["content"][0].update(tool_use_id="nope")),
     "messages[2].content[0].tool_use_id"),
    (_an(lambda b: b["messages"][1]["content"][2].update(input="{}")),
     "messages[1].content[2].input"),
    (_an(lambda b: b["messages"][1]["content"][0].update(signature=5)),
     "messages[1].content[0].signature"),
    (_an(lambda b: b.update(metadata="x")), "metadata"),
    (_an(lambda b: b.update(stop_sequences="x")), "stop_sequences"),
    (_an(lambda b: b["thinking"].update(budget_tokens=0)), "thinking.budget_tokens"),
    (_an(lambda b: b.update(tool_choice={"type": "tool", "name": "zzz"})), "tool_choice"),
]


@pytest.mark.parametrize("body,param", OPENAI_API_RULES)
def test_openai_api_rules_strict_only(body: dict, param: str) -> None:
    with pytest.raises(ChatInputError) as e:
        openai_request(body)
    assert e.value.param == param, e.value.message
    openai_to_template(body)


@pytest.mark.parametrize("body,param", ANTHROPIC_API_RULES)
def test_anthropic_api_rules_strict_only(body: dict, param: str) -> None:
    with pytest.raises(ChatInputError) as e:
        anthropic_request(body)
    assert e.value.param == param, e.value.message
    anthropic_to_template(body)


@pytest.mark.parametrize("choice,tools,want", [
    (None, True, "auto"), ("none", True, "none"), ("required", True, "required"),
    ({"type": "function", "function": {"name": "bash"}}, True, "name:bash"),
    ("auto", False, "auto"), ("none", False, "none")])
def test_openai_tool_choice_normalised(choice: Any, tools: bool, want: str) -> None:
    body = _oa(tool_choice=choice) if tools else {**_oa(tool_choice=choice), "tools": None}
    cr = openai_request(body)
    assert cr.tool_choice == want
    assert cr.prompt_tools == (None if want == "none" or not tools else cr.template.tools)


@pytest.mark.parametrize("choice,want", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "bash"}, "name:bash")])
def test_anthropic_tool_choice_normalised(choice: dict, want: str) -> None:
    cr = anthropic_request(_an(lambda b: b.update(tool_choice=choice)))
    assert cr.tool_choice == want
    assert (cr.prompt_tools is None) == (want == "none")


def test_forcing_a_call_without_tools_is_refused() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}
    with pytest.raises(ChatInputError) as e:
        anthropic_request(body)
    assert e.value.param == "tool_choice"
    assert anthropic_to_template(body).tools is None



@pytest.mark.parametrize("arguments", [
    "[" * 5000 + "]" * 5000,  # was RecursionError -> 500
    '{"a": ' + "9" * 5000 + "}",  # was ValueError (int digits limit) -> 500
    '{"a": "\\ud800"}',  # was a lone surrogate reaching the tokenizer -> 500
    '{"a": ' * 80 + "1" + "}" * 80,  # deeper than the body's own limit
])
def test_tool_call_arguments_held_to_the_body_limits(arguments: str) -> None:
    """Issue 22: JSON inside tool-call `arguments` is parsed under the body's limits (depth,
    integer size, lone surrogates) and refused as a ChatInputError naming the field."""
    from freetoken.chat import ChatInputError, openai_request

    body = {"model": "m", "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    with pytest.raises(ChatInputError) as e:
        openai_request(body)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
