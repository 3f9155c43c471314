"""DeepSeek-V3.1's and Kimi's (K2 / Kimi-Linear) tool-call formats through the output parser, and
anchors on their special tokens. The oracle is each format as its model card documents it:

- DeepSeek-V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3's `function<｜tool▁sep｜>NAME\\n```json ...` too);
- Kimi: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`.

DeepSeek's anchors are checked on DeepSeek-V3's own template rendering
(tests/data/chat_templates/deepseek_v3.jinja); Kimi-Linear's template is not available offline
(docs/models.md), so its anchors are checked on a prompt written in the format of K2's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from freetoken.chat import ChatTokenizer
from freetoken.chat.output import OutputParser, ReasoningDelta, TextDelta, ToolCall
from freetoken.chat.tool_parsers import parse_deepseek_call, parse_kimi_call

DS = {"calls": "<｜tool▁calls▁begin｜>", "calls_end": "<｜tool▁calls▁end｜>",
      "call": "<｜tool▁call▁begin｜>", "call_end": "<｜tool▁call▁end｜>", "sep": "<｜tool▁sep｜>"}
DS_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
               "<think>", "</think>", *DS.values(), "<｜tool▁outputs▁begin｜>",
               "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
KIMI_SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                 "<think>", "</think>"]


def _stand_in(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "system": 1, "user": 2, "assistant": 3,
                                      "tool": 4, "developer": 5}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return tok


def _events(tok, family: str, text: str, step: int, reasoning: bool = False) -> list:
    p = OutputParser(tok, family=family, starts_in_reasoning=reasoning,
                     id_factory=lambda i: f"c{i}")
    ev = [e for i in range(0, len(text), step) for e in p.push_text(text[i:i + step])]
    return ev + p.finish()


def _split(ev: list) -> tuple[str, str, list[tuple[str, dict]]]:
    return ("".join(e.text for e in ev if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in ev if isinstance(e, TextDelta)),
            [(e.name, json.loads(e.arguments)) for e in ev if isinstance(e, ToolCall)])


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_deepseek_v31_calls_stream(step: int) -> None:
    tok = ChatTokenizer(_stand_in(DS_SPECIALS), None, {}, [1])
    text = ("Need the files.</think>Listing."
            f"{DS['calls']}{DS['call']}bash{DS['sep']}{{\"command\": \"ls -la\"}}{DS['call_end']}"
            f"{DS['call']}read{DS['sep']}{{\"path\": \"a\", \"n\": [1, 2]}}{DS['call_end']}"
            f"{DS['calls_end']}")
    reasoning, content, calls = _split(_events(tok, "deepseek_v3", text, step, reasoning=True))
    assert (reasoning, content) == ("Need the files.", "Listing.")
    assert calls == [("bash", {"command": "ls -la"}), ("read", {"path": "a", "n": [1, 2]})]


def test_deepseek_bodies() -> None:
    sep = DS["sep"]
    assert parse_deepseek_call(f"f{sep}{{}}") == ("f", "{}")
    v3 = f"function{sep}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```"
    assert parse_deepseek_call(v3) == ("get_weather", '{"city": "Paris"}')
    for bad in ("f{}", f"{sep}{{}}", f"f{sep}[1]", f"f{sep}{{", f"two\nlines{sep}{{}}"):
        assert parse_deepseek_call(bad) is None, bad


def test_deepseek_malformed_call_is_text() -> None:
    tok = ChatTokenizer(_stand_in(DS_SPECIALS), None, {}, [1])
    text = f"{DS['calls']}{DS['call']}bash{DS['sep']}{{oops{DS['call_end']}{DS['calls_end']}"
    ev = _events(tok, "deepseek_v3", text, 3)
    assert not [e for e in ev if isinstance(e, ToolCall)]
    assert _split(ev)[1] == f"{DS['call']}bash{DS['sep']}{{oops{DS['call_end']}"


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_kimi_calls_stream(step: int) -> None:
    tok = ChatTokenizer(_stand_in(KIMI_SPECIALS), None, {}, [1])
    text = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>'
            "<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>"
            '{"q": "rain", "k": 3}<|tool_call_end|><|tool_calls_section_end|>')
    reasoning, content, calls = _split(_events(tok, "kimi_linear", text, step))
    assert (reasoning, content) == ("", "Let me check.")
    assert calls == [("get_weather", {"city": "Beijing"}), ("search", {"q": "rain", "k": 3})]


def test_kimi_bodies() -> None:
    arg = "<|tool_call_argument_begin|>"
    assert parse_kimi_call(f"functions.my.tool:12{arg}{{}}") == ("my.tool", "{}")
    assert parse_kimi_call(f"bash{arg}{{\"a\": 1}}") == ("bash", '{"a": 1}')
    for bad in ("functions.f:0{}", f"{arg}{{}}", f"functions.f:0{arg}[]", f"f{arg}{{"):
        assert parse_kimi_call(bad) is None, bad


def test_deepseek_anchors_on_its_template() -> None:
    template = (Path(__file__).parents[1] / "data" / "chat_templates"
                / "deepseek_v3.jinja").read_text()
    bos = "<｜begin▁of▁sentence｜>"
    eos = "<｜end▁of▁sentence｜>"
    tok = ChatTokenizer(_stand_in(DS_SPECIALS), template, {"bos_token": bos, "eos_token": eos},
                        [1])
    conv = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "ls"},
            {"role": "assistant", "content": "Running."}, {"role": "tool", "content": "a b"},
            {"role": "tool", "content": "c"}, {"role": "user", "content": "thanks"}]
    p = tok.apply(conv, None, None)
    special = {i: t for t, i in tok.special_ids.items()}
    got = [(a.kind, a.role, special.get(p.input_ids[a.position])) for a in p.anchors]
    assert got == [
        ("turn_start", "system", bos), ("head_end", None, "<｜User｜>"),
        ("turn_start", "user", "<｜User｜>"), ("turn_start", "assistant", "<｜Assistant｜>"),
        ("turn_start", "tool", "<｜tool▁outputs▁begin｜>"),
        ("tool_result_start", None, "<｜tool▁output▁begin｜>"),
        ("tool_result_end", None, "<｜tool▁output▁end｜>"),
        ("tool_result_start", None, "<｜tool▁output▁begin｜>"),
        ("tool_result_end", None, "<｜tool▁output▁end｜>"),
        ("turn_start", "user", "<｜User｜>"), ("turn_start", "assistant", "<｜Assistant｜>")]


def test_kimi_anchors_on_its_format() -> None:
    """Roles are the names after `<|im_system|>` / `<|im_user|>` / `<|im_assistant|>` (a
    `tool_declare` block counts as system); the head ends at the first non-system turn."""
    tok = ChatTokenizer(_stand_in(KIMI_SPECIALS), None, {}, [1])
    text = ('<|im_system|>tool_declare<|im_middle|>[{"type": "function"}]<|im_end|>'
            "<|im_system|>system<|im_middle|>Be terse.<|im_end|>"
            "<|im_user|>user<|im_middle|>ls<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>ok<|tool_calls_section_begin|>"
            "<|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_calls_section_end|><|im_end|>"
            "<|im_system|>tool<|im_middle|>## Return of functions.bash:0\na<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>")
    from freetoken.chat import detect_anchors

    ids = tok.encode(text)
    special = {i: t for t, i in tok.special_ids.items()}
    got = [(a.kind, a.role, special.get(ids[a.position]))
           for a in detect_anchors(ids, tok.anchor_tokens)]
    assert got == [
        ("turn_start", "system", "<|im_system|>"), ("turn_start", "system", "<|im_system|>"),
        ("head_end", None, "<|im_user|>"), ("turn_start", "user", "<|im_user|>"),
        ("turn_start", "assistant", "<|im_assistant|>"),
        ("tool_call_start", None, "<|tool_calls_section_begin|>"),
        ("turn_start", "tool", "<|im_system|>"),
        ("turn_start", "assistant", "<|im_assistant|>")]
