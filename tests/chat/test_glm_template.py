"""GLM-5's chat template (tests/data/chat_templates/glm_5.jinja) rendered by our ChatTokenizer as
transformers' `apply_chat_template` renders it (system, tools, reasoning, tool calls, runs of
tool results, thinking off); the tool calls and reasoning the template writes parsed back by
the output parser (the format's own text is the oracle); anchors on GLM's special tokens. The
tokenizer is a stand-in holding GLM's special tokens (the real `tokenizer.json` is not
shipped): rendering reads the template and the special tokens, not the vocabulary."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from freetoken.chat import ChatTokenizer
from freetoken.chat.output import OutputParser, ReasoningDelta, TextDelta, ToolCall

TEMPLATE = (Path(__file__).parents[1] / "data" / "chat_templates" / "glm_5.jinja").read_text()
SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
            "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"]
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"},
                                                    "timeout": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "lines": {"type": "array"}}}}}]
CALL = {"type": "function", "function": {"name": "bash",
                                         "arguments": {"command": "ls -la", "timeout": 30}}}
CALL2 = {"type": "function", "function": {"name": "read",
                                          "arguments": {"path": "a.txt", "lines": [1, 2]}}}
CONV: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List files."},
    {"role": "assistant", "content": "Running ls.", "reasoning_content": "Use bash.",
     "tool_calls": [CALL, CALL2]},
    {"role": "tool", "content": "a.txt\nb.txt"},
    {"role": "tool", "content": "1\n2"},
    {"role": "assistant", "content": "<think>Two files.</think>\nThere are two."},
    {"role": "user", "content": [{"type": "text", "text": "\u4e2d\u6587, thanks."}]},
]


def _stand_in() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


@pytest.fixture(scope="module")
def pair() -> tuple[ChatTokenizer, Any]:
    transformers = pytest.importorskip("transformers")
    ours = ChatTokenizer(_stand_in(), TEMPLATE, {"eos_token": "<|endoftext|>"}, [1])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_stand_in(),
                                              eos_token="<|endoftext|>")
    hf.chat_template = TEMPLATE
    return ours, hf


@pytest.mark.parametrize("cut", range(1, len(CONV) + 1))
@pytest.mark.parametrize("agp,think", [(True, None), (False, None), (True, False)])
def test_render_matches_transformers(pair, cut: int, agp: bool, think: bool | None) -> None:
    ours, hf = pair
    msgs = CONV[:cut]
    kw = {} if think is None else {"enable_thinking": think}
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(msgs, tools=tools, tokenize=False,
                                      add_generation_prompt=agp, **kw)
        assert ours.render(msgs, tools, think, agp) == want
        assert want.startswith("[gMASK]<sop>")


def test_keep_all_reasoning_makes_prompts_append_only(pair) -> None:
    """GLM drops reasoning of turns before the last user query (`ns.last_user_index`): a new
    query rewrites the middle of the prompt. Kept, each turn renders as it was generated."""
    ours, _ = pair
    before = ours.render(CONV[:6], TOOLS, None, False)
    after = ours.render(CONV, TOOLS, None, True)
    assert "<think>Use bash.</think>" in before and "<think>Use bash.</think>" not in after
    kept = ours.render(CONV, TOOLS, None, True, keep_all_reasoning=True)
    assert kept.startswith(ours.render(CONV[:6], TOOLS, None, False, keep_all_reasoning=True))


def _generated(pair, turn: dict[str, Any]) -> str:
    """What the model wrote for `turn`: the template's rendering of it after the generation
    prompt `<|assistant|><think>` of the same conversation."""
    ours, _ = pair
    head = ours.render(CONV[:2], TOOLS, None, True)
    full = ours.render([*CONV[:2], turn], TOOLS, None, False)
    assert head.endswith("<|assistant|><think>") and full.startswith(head[:-len("<think>")])
    return full[len(head):]


def test_template_tool_calls_parse_back(pair) -> None:
    text = _generated(pair, CONV[2])
    assert text == ("Use bash.</think>Running ls.<tool_call>bash<arg_key>command</arg_key>"
                    "<arg_value>ls -la</arg_value><arg_key>timeout</arg_key><arg_value>30"
                    "</arg_value></tool_call><tool_call>read<arg_key>path</arg_key><arg_value>"
                    "a.txt</arg_value><arg_key>lines</arg_key><arg_value>[1, 2]</arg_value>"
                    "</tool_call>")
    ours, _ = pair
    for step in (1, 7, len(text)):  # streamed in pieces that split the tags
        p = OutputParser(ours, family="glm_moe_dsa", starts_in_reasoning=True, tools=TOOLS,
                         id_factory=lambda i: f"c{i}")
        ev = [e for i in range(0, len(text), step) for e in p.push_text(text[i:i + step])]
        ev += p.finish()
        assert "".join(e.text for e in ev if isinstance(e, ReasoningDelta)) == "Use bash."
        assert "".join(e.text for e in ev if isinstance(e, TextDelta)) == "Running ls."
        calls = [e for e in ev if isinstance(e, ToolCall)]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("bash", {"command": "ls -la", "timeout": 30}),
            ("read", {"path": "a.txt", "lines": [1, 2]})]


def test_glm_call_values_follow_the_schema() -> None:
    from freetoken.chat.tool_parsers import parse_glm_call, tool_schemas

    body = "bash<arg_key>command</arg_key><arg_value>42</arg_value>"
    assert json.loads(parse_glm_call(body, tool_schemas(TOOLS))[1]) == {"command": "42"}
    assert json.loads(parse_glm_call(body)[1]) == {"command": 42}
    # GLM-4.5's layout: newlines between the parts
    old = "bash\n<arg_key>command</arg_key>\n<arg_value>ls\n-l</arg_value>\n"
    assert parse_glm_call(old) == ("bash", '{"command": "ls\\n-l"}')
    assert parse_glm_call("bash") == ("bash", "{}")
    junk = "bash<arg_key>a</arg_key><arg_value>1</arg_value> junk"
    for bad in ("", "bash<arg_key>command</arg_key>", junk, "two words\nname"):
        assert parse_glm_call(bad) is None, bad


def test_anchors_on_glm_tokens(pair) -> None:
    ours, _ = pair
    p = ours.apply(CONV, TOOLS, None)
    special = {i: t for t, i in ours.special_ids.items()}
    got = [(a.kind, a.role, special.get(p.input_ids[a.position])) for a in p.anchors
           if a.kind != "tool_def"]
    assert got == [
        ("turn_start", "system", "<|system|>"),  # the tools block; its quoted tags: no anchor
        ("turn_start", "system", "<|system|>"),
        ("head_end", None, "<|user|>"), ("turn_start", "user", "<|user|>"),
        ("turn_start", "assistant", "<|assistant|>"),
        ("think_start", None, "<think>"), ("think_end", None, "</think>"),
        ("tool_call_start", None, "<tool_call>"), ("tool_call_start", None, "<tool_call>"),
        ("turn_start", "tool", "<|observation|>"),
        ("tool_result_start", None, "<tool_response>"),
        ("tool_result_end", None, "</tool_response>"),
        ("tool_result_start", None, "<tool_response>"),
        ("tool_result_end", None, "</tool_response>"),
        # the template's empty `</think>`: the message's own `<think>...</think>` text is
        # plain text (control-token strings in content are escaped), so not reasoning
        ("turn_start", "assistant", "<|assistant|>"), ("think_end", None, "</think>"),
        ("turn_start", "user", "<|user|>"),
        ("turn_start", "assistant", "<|assistant|>"), ("think_start", None, "<think>")]
