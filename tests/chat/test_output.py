"""OutputParser and tool-call parsers: expected events, split-invariance (token by token, random
chunks, character by character), malformed calls, and the round trip through the template."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest

from freetoken.chat import (
    ChatTokenizer,
    OutEvent,
    OutputParser,
    ReasoningDelta,
    TextDelta,
    ToolCall,
)
from freetoken.chat.tool_parsers import (
    parse_json_call,
    parse_tool_call,
    parse_xml_call,
    tool_schemas,
)

TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "force": {"type": "boolean"},
    "tags": {"type": "array"}, "note": {"type": ["string", "null"]}}}}}]
BASH = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la 東京"}}\n</tool_call>'
XML = ("<tool_call>\n<function=edit>\n<parameter=path>\n007.txt\n</parameter>\n"
       "<parameter=line>\n12\n</parameter>\n<parameter=force>\ntrue\n</parameter>\n"
       "<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
       "<parameter=body>\nline1\n\nline2 < 3\n</parameter>\n</function>\n</tool_call>")
XML_ARGS = {"path": "007.txt", "line": 12, "force": True, "tags": ["a", 1],
            "body": "line1\n\nline2 < 3"}
R, T = ReasoningDelta, TextDelta


def tc(i: int, name: str, args: dict[str, Any]) -> ToolCall:
    return ToolCall(i, "", name, json.dumps(args, ensure_ascii=False))


CASES: list[tuple[str, dict[str, Any], str, list[OutEvent]]] = [
    ("think_then_text", {}, "<think>\nLet me think.\nTwo lines.\n</think>\n\nHello 世界 🎉",
     [R("Let me think.\nTwo lines."), T("Hello 世界 🎉")]),
    ("starts_in_reasoning", {"starts_in_reasoning": True}, "Reason.\n</think>\n\nAnswer.",
     [R("Reason."), T("Answer.")]),
    ("thinking_off_no_reasoning_state", {"thinking": False, "starts_in_reasoning": True},
     "Plain answer.", [T("Plain answer.")]),
    ("text_and_two_calls", {}, "<think>\nr\n</think>\n\nI'll list.\n" + BASH + "\n" + BASH,
     [R("r"), T("I'll list."), tc(0, "bash", {"command": "ls -la 東京"}),
      tc(1, "bash", {"command": "ls -la 東京"})]),
    ("xml_with_schema", {"family": "qwen3_5"}, "Editing.\n\n" + XML,
     [T("Editing."), tc(0, "edit", XML_ARGS)]),
    ("call_inside_reasoning", {"starts_in_reasoning": True},
     "hmm\n" + BASH + "\nmore\n</think>\n\nok",
     [R("hmm"), tc(0, "bash", {"command": "ls -la 東京"}), R("more"), T("ok")]),
    ("malformed_json_call", {},
     'A\n<tool_call>\n{"name": "bash", "arguments": {oops}\n</tool_call>',
     [T('A<tool_call>\n{"name": "bash", "arguments": {oops}\n</tool_call>')]),
    ("malformed_in_reasoning", {"starts_in_reasoning": True},
     "<tool_call>nope</tool_call></think>x",
     [R("<tool_call>nope</tool_call>"), T("x")]),
    ("unterminated_complete_call", {}, '<tool_call>\n{"name": "f", "arguments": {}}\n',
     [tc(0, "f", {})]),
    ("unterminated_broken_call", {}, '<tool_call>\n{"name": "f", "argu',
     [T('<tool_call>\n{"name": "f", "argu')]),
    ("tag_lookalikes", {"thinking": False}, "Use <tool> & <thin> tags; 3 < 4 </think",
     [T("Use <tool> & <thin> tags; 3 < 4 </think")]),
    ("late_think_is_text", {}, "Answer <think>not reasoning</think>",
     [T("Answer <think>not reasoning</think>")]),
    ("trailing_partial_tag", {}, "ends with <tool_ca", [T("ends with <tool_ca")]),
]


def merged(events: list[OutEvent]) -> list[OutEvent]:
    """Join adjacent deltas of one kind and blank call ids (chunking and ids are free)."""
    out: list[OutEvent] = []
    for e in events:
        if isinstance(e, ToolCall):
            assert e.id.startswith("call_")
            out.append(ToolCall(e.index, "", e.name, e.arguments))
        elif out and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)  # type: ignore[union-attr]
        else:
            out.append(e)
    return out


def run_ids(tok: ChatTokenizer, ids: list[int], kw: dict[str, Any],
            sizes: list[int]) -> list[OutEvent]:
    p = OutputParser(tok, tools=TOOLS, **kw)
    events, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        events += p.push(ids[i : i + n])
        i, k = i + n, k + 1
    return events + p.finish()


@pytest.mark.parametrize("name,kw,text,want", CASES, ids=[c[0] for c in CASES])
def test_events_are_split_invariant(tok: ChatTokenizer, name: str, kw: dict[str, Any], text: str,
                                    want: list[OutEvent]) -> None:
    ids = tok.encode(text) + [tok.eos_token_ids[0]]
    rng = random.Random(name)
    splits = [[len(ids)], [1]] + [[rng.randint(1, 5) for _ in range(7)] for _ in range(4)]
    for sizes in splits:
        assert merged(run_ids(tok, ids, kw, sizes)) == want, sizes
    for _ in range(6):  # character-level splits cut every tag in every place
        p = OutputParser(tok, tools=TOOLS, **kw)
        events, i = [], 0
        while i < len(text):
            n = rng.randint(1, 4)
            events += p.push_text(text[i : i + n])
            i += n
        assert merged(events + p.finish()) == want


def test_call_indices_and_unique_ids(tok: ChatTokenizer) -> None:
    p = OutputParser(tok)
    ev = p.push(tok.encode(BASH + BASH + BASH)) + p.finish()
    assert [e.index for e in ev if isinstance(e, ToolCall)] == [0, 1, 2]
    assert len({e.id for e in ev if isinstance(e, ToolCall)}) == 3 and p.tool_calls == 3
    with pytest.raises(ValueError):
        OutputParser(tok, family="llama9")


def test_round_trip_through_template_is_append_only(tok: ChatTokenizer) -> None:
    """Parsed output sent back as an assistant message re-renders to prompt + output."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "List files."}]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    for content in ("I'll list.\n", ""):
        prompt = tok.apply(msgs, tools)
        out = "<think>\nNeed ls.\n</think>\n\n" + content + BASH + "<|im_end|>"
        p = OutputParser(tok, starts_in_reasoning=prompt.opens_reasoning)
        ev = merged(p.push(tok.encode(out)) + p.finish())
        msg: dict[str, Any] = {"role": "assistant", "tool_calls": [], "content": ""}
        for e in ev:
            if isinstance(e, ReasoningDelta):
                msg["reasoning_content"] = e.text
            elif isinstance(e, TextDelta):
                msg["content"] = e.text
            else:
                msg["tool_calls"].append({"type": "function", "function": {
                    "name": e.name, "arguments": json.loads(e.arguments)}})
        again = tok.apply(msgs + [msg], tools, add_generation_prompt=False)
        assert again.text == prompt.text + out + "\n"
        assert again.input_ids[: len(prompt.input_ids)] == prompt.input_ids


def test_tool_parsers_directly() -> None:
    schemas = tool_schemas(TOOLS)
    assert parse_json_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ("f", '{"a": 1}')
    assert parse_json_call('{"name": "f", "parameters": {"a": [1]}}') == ("f", '{"a": [1]}')
    for bad in ('{"arguments": {}}', '{"name": "f", "arguments": [1]}', '["f"]', "{",
                '{"name": ""}'):
        assert parse_json_call(bad) is None
    body = ("<function=edit>\n<parameter=path>\n12\n</parameter>\n<parameter=note>\nnull\n"
            "</parameter>\n</function>")
    assert parse_xml_call(body, schemas) == ("edit", '{"path": "12", "note": null}')
    assert parse_xml_call(body) == ("edit", '{"path": 12, "note": null}')  # no schema: JSON first
    # missing </parameter> and </function> are tolerated; stray text is not
    assert parse_xml_call("<function=f>\n<parameter=a>\nx\n<parameter=b>\n2\n") == (
        "f", '{"a": "x", "b": 2}')
    assert parse_xml_call("<function=f>\njunk\n<parameter=a>\n1\n</parameter>\n</function>") is None
    assert parse_xml_call("<function=f>\n</function>\ntrailing") is None
    assert parse_tool_call("\n<function=g>\n</function>\n") == ("g", "{}")
    assert parse_tool_call("garbage", "xml") is None and parse_tool_call("garbage") is None


def test_offered_name_maps_only_an_unambiguous_case_slip() -> None:
    from freetoken.chat.tool_parsers import offered_name

    offered = tool_schemas([{"name": "Bash", "input_schema": {}},
                            {"name": "Read", "input_schema": {}}])
    assert offered_name("Bash", offered) == ("Bash", None)
    assert offered_name("bash", offered) == ("Bash", "case")
    assert offered_name("grep", offered) == ("grep", "not_offered")
    assert offered_name("bash", {}) == ("bash", None)  # no tools offered: nothing to check
    both = tool_schemas([{"name": "Bash"}, {"name": "bash"}])
    assert offered_name("BASH", both) == ("BASH", "not_offered")  # two spellings: no guess


def test_a_call_takes_the_offered_spelling_of_its_tool(tok: ChatTokenizer, caplog) -> None:
    """A bare /v1/messages request offering `Bash` got a `bash` tool_use back (a model
    trained on another harness's tools): the call now names the offered tool, with one log
    line saying so; a tool the request never offered keeps the model's name."""
    import logging

    tools = [{"type": "function", "function": {"name": "Bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}}]
    text = BASH + '\n<tool_call>\n{"name": "glob", "arguments": {}}\n</tool_call>'
    with caplog.at_level(logging.INFO, logger="ft.chat"):
        p = OutputParser(tok, tools=tools)
        events = merged(p.push(tok.encode(text)) + p.finish())
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("Bash", {"command": "ls -la 東京"}), ("glob", {})]
    msgs = [r.getMessage() for r in caplog.records if "tool_call_name" in r.getMessage()]
    assert msgs == ["tool_call_name name=Bash wrote=bash why=case",
                    "tool_call_name name=glob wrote=glob why=not_offered"]
