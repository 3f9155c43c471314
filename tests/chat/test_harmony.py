"""The harmony chat format (gpt-oss): rendering (freetoken/chat/harmony.py) and the streaming
output parser (freetoken/chat/harmony_output.py).

Rendering is held to literal prompts in the published format of gpt-oss's official chat template
(system message, `# Instructions`, the `functions` namespace as TypeScript-like declarations
with the template's own layout, channels, tool calls and results, the analysis of earlier turns
dropped once a final answer follows), and to the cases where we render what the template
refuses or drops. Parsing: render/parse round trips (what the model writes after the generation
prompt parses back to the assistant message it renders), the streamed parse split at every
byte boundary equal to the whole parse, and malformed output passed on as text."""
from __future__ import annotations

import json

import pytest

from freetoken.chat import ChatInputError, ReasoningDelta, TextDelta, ToolCall
from freetoken.chat.harmony import HarmonyOptions, render_harmony, ts_type
from freetoken.chat.harmony_output import HarmonyOutputParser, parse_output_header
from freetoken.chat.output import output_parser
from freetoken.chat.tokenizer import normalize_messages
from tests.chat.harmony_fixtures import byte_ids, harmony_tokenizer

DATE = HarmonyOptions(date="2025-06-28")
SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI."
          "\nKnowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: {effort}\n\n"
          "# Valid channels: analysis, commentary, final. Channel must be included for every "
          "message.{calls}<|end|>")
CALLS_LINE = "\nCalls to these tools must go to the commentary channel: 'functions'."
WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Gets the current weather in the provided "
    "location.", "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San "
                     "Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["location"]}}}
LOCATION = {"type": "function", "function": {"name": "get_location",
                                             "description": "Gets the location of the user."}}


def _render(msgs, tools=None, agp=True, opts=DATE) -> str:
    return render_harmony(normalize_messages(msgs), tools, agp, opts)


def _call(name: str, args: dict, cid: str | None = None) -> dict:
    c = {"type": "function", "function": {"name": name, "arguments": args}}
    return {**c, "id": cid} if cid else c


def test_system_developer_and_tools() -> None:
    got = _render([{"role": "system", "content": "Always respond in riddles"},
                   {"role": "user", "content": "What is the weather like in SF?"}],
                  [LOCATION, WEATHER], opts=HarmonyOptions("high", date="2025-06-28"))
    want = (SYSTEM.format(effort="high", calls=CALLS_LINE)
            + "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles\n\n"
            "# Tools\n\n## functions\n\nnamespace functions {\n\n"
            "// Gets the location of the user.\ntype get_location = () => any;\n\n"
            "// Gets the current weather in the provided location.\n"
            "type get_current_weather = (_: {\n"
            "// The city and state, e.g. San Francisco, CA\nlocation: string,\n"
            'format?: "celsius" | "fahrenheit", // default: celsius,\n'
            "}) => any;\n\n} // namespace functions<|end|>"
            "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant")
    assert got == want


def test_no_system_no_tools_and_effort() -> None:
    got = _render([{"role": "user", "content": "Hi"}], opts=HarmonyOptions("low", date=DATE.date))
    assert got == (SYSTEM.format(effort="low", calls="")
                   + "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    with pytest.raises(ChatInputError, match="reasoning effort"):
        _render([{"role": "user", "content": "Hi"}], opts=HarmonyOptions("max"))


def test_tool_call_and_result() -> None:
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
             "tool_calls": [_call("get_current_weather", {"location": "Paris"}, "c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'}]
    got = _render(msgs, [WEATHER])
    tail = got[got.index("<|start|>user"):]
    assert tail == ("<|start|>user<|message|>Weather?<|end|>"
                    "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
                    "<|start|>assistant to=functions.get_current_weather<|channel|>commentary "
                    'json<|message|>{"location": "Paris"}<|call|>'
                    "<|start|>functions.get_current_weather to=assistant<|channel|>commentary"
                    '<|message|>"{\\"temp\\": 20}"<|end|><|start|>assistant')
    # the official template writes a call without reasoning's text as its analysis
    no_r = _render([msgs[0], {**msgs[1], "content": "Checking.", "reasoning_content": None},
                    msgs[2]], [WEATHER])
    assert "<|channel|>analysis<|message|>Checking.<|end|><|start|>assistant to=" in no_r


def test_earlier_analysis_dropped_after_a_final_answer() -> None:
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
             "tool_calls": [_call("get_current_weather", {"location": "Paris"})]},
            {"role": "tool", "content": "20"},
            {"role": "assistant", "content": "It is 20.", "reasoning_content": "Easy."},
            {"role": "user", "content": "Thanks"}]
    got = _render(msgs, [WEATHER])
    assert "analysis" not in got.split("<|end|>", 2)[2]  # no analysis message at all
    assert ("<|start|>assistant<|channel|>final<|message|>It is 20.<|end|><|start|>user"
            "<|message|>Thanks<|end|><|start|>assistant") in got
    # a last assistant turn without the generation prompt keeps its analysis and returns
    last = _render(msgs[:4], [WEATHER], agp=False)
    assert last.endswith("<|start|>assistant<|channel|>analysis<|message|>Easy.<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>It is 20.<|return|>")


def test_what_the_template_refuses_or_drops() -> None:
    two = [{"role": "user", "content": "Both?"},
           {"role": "assistant", "content": "Looking both up.", "reasoning_content": "Two.",
            "tool_calls": [_call("get_location", {}, "a"),
                           _call("get_current_weather", {"location": "X"}, "b")]},
           {"role": "tool", "tool_call_id": "b", "content": "cold"},
           {"role": "tool", "tool_call_id": "a", "content": "home"},
           {"role": "system", "content": "Be brief."}]
    got = _render(two, [LOCATION, WEATHER])
    assert ("<|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Looking both up.<|end|>"
            "<|start|>assistant to=functions.get_location<|channel|>commentary json<|message|>"
            "{}<|call|><|start|>assistant to=functions.get_current_weather<|channel|>commentary"
            ' json<|message|>{"location": "X"}<|call|>'
            '<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>'
            '"cold"<|end|><|start|>functions.get_location to=assistant<|channel|>commentary'
            '<|message|>"home"<|end|><|start|>developer<|message|>Be brief.<|end|>') in got
    nodesc = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"k": {"type": "string", "enum": [1, 2], "default": 1}}}}}
    assert "namespace functions {\n\ntype f = (_: {\nk?: \"1\" | \"2\", // default: 1,\n})" in (
        _render([{"role": "user", "content": "x"}], [nodesc]))


def test_refusals() -> None:
    with pytest.raises(ChatInputError, match="no earlier assistant"):
        _render([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
    with pytest.raises(ChatInputError, match="channel tags"):
        _render([{"role": "user", "content": "x"}, {"role": "assistant",
                 "content": "a<|channel|>final<|message|>b"}])


def test_typescript_types() -> None:
    assert ts_type({"type": "array", "items": {"type": "integer"}}) == "number[]"
    assert ts_type({"type": "array", "nullable": True}) == "any[] | null"
    assert ts_type({"type": ["string", "null"]}) == "string | null"
    assert ts_type({"type": "string", "nullable": True}) == "string | null"
    assert ts_type({"oneOf": [{"type": "string"}, {"type": "number"}]}) == "string | \nnumber"
    assert ts_type({"type": "object", "properties": {"a": {"type": "boolean"}},
                    "required": ["a"]}) == "{\na: \n" + " " * 16 + "boolean}"
    assert ts_type({"type": "array", "items": {"type": "array", "items": {"type": "string"}}}
                   ) == "string[][]"
    assert ts_type({}) == "any"


def test_chat_tokenizer_renders_harmony() -> None:
    ct = harmony_tokenizer()
    p = ct.apply([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert "Reasoning: low" in p.text and p.text.endswith("<|start|>assistant")
    assert "Reasoning: high" in ct.render([{"role": "user", "content": "Hi"}],
                                          reasoning_effort="high")
    assert ct.decode(p.input_ids) == p.text


# -- output ----------------------------------------------------------------------------------


def _merge(events) -> list:
    """Consecutive deltas of one kind joined (how the APIs build their blocks)."""
    out: list = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, (ReasoningDelta, TextDelta)):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def _parse(ct, ids, chunks=None) -> list:
    p = HarmonyOutputParser(ct, id_factory=lambda i: f"call_{i}")
    ev = []
    for lo, hi in chunks or [(0, len(ids))]:
        ev += p.push(ids[lo:hi])
    return _merge(ev + p.finish())


def _message(events) -> dict:
    """The assistant message the events describe (what a client sends back)."""
    m: dict = {"role": "assistant", "content": ""}
    for e in events:
        if isinstance(e, ReasoningDelta):
            m["reasoning_content"] = m.get("reasoning_content", "") + e.text
        elif isinstance(e, TextDelta):
            m["content"] += e.text
        else:
            m.setdefault("tool_calls", []).append(_call(e.name, json.loads(e.arguments)))
    return m


CONV = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Wetter in Köln?"}]
TURNS = [
    {"role": "assistant", "content": "", "reasoning_content": "Brauche das Wetter — 🌦 für Köln.",
     "tool_calls": [_call("get_current_weather", {"location": "Köln, 日本", "n": [1, 2.5]})]},
    {"role": "assistant", "content": "Es sind 20 °C 🌤.", "reasoning_content": "Einfach."},
]


@pytest.mark.parametrize("turn", TURNS, ids=["call", "final"])
def test_render_parse_round_trip(turn) -> None:
    """What the model writes after the generation prompt (the rendered turn, as training data
    renders it) parses back to the turn."""
    ct = harmony_tokenizer()
    prompt = _render(CONV, [WEATHER])
    full = _render([*CONV, turn], [WEATHER], agp=False)
    assert full.startswith(prompt)
    completion = full[len(prompt):]
    events = _parse(ct, ct.encode(completion))
    assert _message(events) == turn
    if "tool_calls" in turn:
        assert isinstance(events[-1], ToolCall) and events[-1].index == 0


def test_streamed_parse_equals_whole_at_every_byte_boundary() -> None:
    ct = harmony_tokenizer()
    text = ("<|channel|>analysis<|message|>Köln — 日本 🌦?<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Ich schaue nach.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_current_weather "
            '<|constrain|>json<|message|>{"location": "Köln 🌦"}<|call|>'
            "<|start|>assistant<|channel|>final<|message|>Es ist kalt ❄.<|return|>")
    ids = byte_ids(ct, text)
    assert ct.decode(ids) == text
    whole = _parse(ct, ids)
    assert [type(e) for e in whole] == [ReasoningDelta, TextDelta, ToolCall, TextDelta]
    assert whole[0].text == "Köln — 日本 🌦?" and whole[1].text == "Ich schaue nach."
    assert (whole[2].name, json.loads(whole[2].arguments)) == ("get_current_weather",
                                                               {"location": "Köln 🌦"})
    assert whole[3].text == "Es ist kalt ❄."
    for i in range(1, len(ids)):
        assert _parse(ct, ids, [(0, i), (i, len(ids))]) == whole, i
    assert _parse(ct, ids, [(i, i + 1) for i in range(len(ids))]) == whole
    # and the deltas stream: the analysis arrives before its message closes
    p = HarmonyOutputParser(ct)
    cut = ids.index(ct.special_ids["<|end|>"])
    assert "".join(e.text for e in p.push(ids[:cut])) == "Köln — 日本 🌦?"


def test_malformed_output_is_passed_on() -> None:
    ct = harmony_tokenizer()
    bad = ct.encode("<|channel|>commentary to=functions.f json<|message|>{not json<|call|>")
    assert _parse(ct, bad) == [TextDelta("{not json")]
    # an unterminated call with complete JSON (max_tokens hit) still counts
    cut = ct.encode('<|channel|>commentary to=functions.f<|message|>{"a": 1}')
    assert [(e.name, e.arguments) for e in _parse(ct, cut)] == [("f", '{"a": 1}')]
    # a model that never writes a header: its text, not swallowed
    assert _parse(ct, ct.encode("just words")) == [TextDelta("just words")]
    # a message cut inside its header: dropped
    assert _parse(ct, ct.encode("<|channel|>analy")) == []
    # a header that runs on: passed on as text when it outgrows any header
    long = ct.encode("word " * 80)
    assert "".join(e.text for e in _parse(ct, long)) == "word " * 80


def test_header_parts_and_factory() -> None:
    h = parse_output_header(" to=functions.f<|channel|>commentary json")
    assert (h.role, h.channel, h.recipient, h.content_type) == ("assistant", "commentary",
                                                                "functions.f", "json")
    h = parse_output_header("<|channel|>commentary to=functions.g <|constrain|>json")
    assert (h.channel, h.recipient, h.content_type) == ("commentary", "functions.g", "json")
    assert isinstance(output_parser(harmony_tokenizer(), "gpt_oss"), HarmonyOutputParser)


def test_effort_reaches_the_template_input() -> None:
    from freetoken.chat import anthropic_request, openai_request
    from freetoken.chat.responses_map import to_chat

    msgs = [{"role": "user", "content": "Hi"}]
    assert openai_request({"messages": msgs, "reasoning_effort": "minimal"}
                          ).template.reasoning_effort == "low"
    assert openai_request({"messages": msgs, "reasoning_effort": "high",
                           "chat_template_kwargs": {"reasoning_effort": "medium"}}
                          ).template.reasoning_effort == "medium"
    assert openai_request({"messages": msgs}).template.reasoning_effort is None
    an = {"messages": msgs, "max_tokens": 5, "model": "m"}
    assert anthropic_request({**an, "thinking": {"type": "disabled"}}
                             ).template.reasoning_effort == "low"
    chat, _ = to_chat({"reasoning": {"effort": "high"}}, [{"type": "message", "role": "user",
                                                          "content": "Hi"}])
    assert openai_request(chat).template.reasoning_effort == "high"


def test_gpt_oss_without_harmony_vocabulary_parses_as_qwen() -> None:
    """A gpt-oss shape served over the Qwen3 tokenizer (`ft bench checkpoint`) renders with
    Qwen's template, so its output parses as qwen3's."""
    from freetoken.chat import ChatTokenizer, OutputParser, qwen3_tokenizer_dir

    qwen = ChatTokenizer.from_dir(qwen3_tokenizer_dir())
    p = output_parser(qwen, "gpt_oss")
    assert isinstance(p, OutputParser)
    assert p.push(qwen.encode("<think>r</think>ok")) + p.finish() == [ReasoningDelta("r"),
                                                                     TextDelta("ok")]


def test_tool_def_anchors_mark_where_fewer_tools_part() -> None:
    """A `tool_def` anchor per tool at its block in the `functions` namespace: a prompt with
    only the tools before it (a sub-agent's) shares every token before the anchor."""
    ct = harmony_tokenizer()
    ping = {"type": "function", "function": {"name": "ping", "description": "Ping.\n\nTwice."}}
    tools = [WEATHER, LOCATION, ping]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    full = ct.apply(msgs, tools)
    defs = [a for a in full.anchors if a.kind == "tool_def"]
    assert [a.role for a in defs] == ["get_current_weather", "get_location", "ping"]
    for k in (1, 2):
        fewer = ct.apply(msgs, tools[:k])
        pos = defs[k].position
        assert full.input_ids[:pos] == fewer.input_ids[:pos], k
        assert full.input_ids[:pos + 2] != fewer.input_ids[:pos + 2], k  # and no further
        # at most the previous declaration's `;` glued to the blank line sits after it
        rest = full.text[len(ct.decode(full.input_ids[:pos])):]
        assert rest.lstrip(";\n").startswith("// " + tools[k]["function"]["description"])
        assert len(rest) - len(rest.lstrip(";\n")) <= 3


def test_a_harmony_call_takes_the_offered_spelling_of_its_tool() -> None:
    ct = harmony_tokenizer()
    text = ("<|channel|>commentary to=functions.GET_CURRENT_WEATHER <|constrain|>json"
            '<|message|>{"location": "Köln"}<|call|>')
    p = HarmonyOutputParser(ct, tools=[WEATHER], id_factory=lambda i: f"call_{i}")
    events = _merge(p.push(byte_ids(ct, text)) + p.finish())
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [c.name for c in calls] == ["get_current_weather"]
