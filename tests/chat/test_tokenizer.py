"""ChatTokenizer against transformers (the oracle for encoding and template rendering)."""
from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from freetoken.chat import ChatInputError, ChatTokenizer, anthropic_to_template, openai_to_template

TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                      "parameters": {"type": "object", "properties": {
                                          "command": {"type": "string"}},
                                      "required": ["command"]}}},
    {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}},
]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "bash", "arguments": {"command": "ls -la \u00e9\u4e2d"}}}
CONV: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List files."},
    {"role": "assistant", "content": "", "reasoning_content": "\nI should run ls.\n",
     "tool_calls": [CALL]},
    {"role": "tool", "content": "a.txt\nb.txt", "tool_call_id": "c1"},
    {"role": "tool", "content": "second result", "tool_call_id": "c2"},
    {"role": "assistant", "content": "Two files.", "reasoning_content": "Summarise."},
    {"role": "user", "content": "Thanks. <think>not a tag</think>"},
    {"role": "assistant", "content": "<think>\nold style\n</think>\n\nYou're welcome."},
    {"role": "system", "content": "Mid-conversation system note."},
    {"role": "user", "content": "Again, with a call and text."},
    {"role": "assistant", "content": "Sure.", "tool_calls": [CALL, CALL]},
]


def test_loads_real_qwen3(tok: ChatTokenizer) -> None:
    assert tok.eos_token_ids == [151645]
    assert tok.special_ids["<|im_start|>"] == 151644
    assert tok.special_ids["<think>"] == 151667 and tok.special_ids["</think>"] == 151668
    assert tok.encode("<|im_start|>user\n<tool_call>x") == [151644, 872, 198, 151657, 87]
    assert tok.decode([151644, 872]) == "<|im_start|>user"


@pytest.mark.parametrize("text", ["Hello world", "  leading\n\n\tspaces ",
                                  "\u4e2d\u6587\u6d4b\u8bd5 \U0001f600",
                                  "<|im_start|>assistant\n<think>\nhm</think>\n\n<tool_call>",
                                  "<|endoftext|>x<|im_end|>"])
def test_encode_decode_match_transformers(tok: ChatTokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids) == text


@pytest.mark.parametrize("cut", range(2, len(CONV) + 1))
@pytest.mark.parametrize("thinking", [None, True, False])
def test_render_matches_transformers(tok: ChatTokenizer, hf_tok: Any, cut: int,
                                     thinking: bool | None) -> None:
    msgs = CONV[:cut]
    kw = {} if thinking is None else {"enable_thinking": thinking}
    for tools in (None, TOOLS):
        for agp in (True, False):
            want = hf_tok.apply_chat_template(msgs, tools=tools, tokenize=False,
                                              add_generation_prompt=agp, **kw)
            got = tok.render(msgs, tools, thinking, agp, keep_all_reasoning=False)
            assert got == want


def test_traces_render_like_transformers(tok: ChatTokenizer, hf_tok: Any, trace_reqs: list) -> None:
    reqs = trace_reqs
    assert len(reqs) >= 50
    for name, rec in reqs:
        body = rec["body"]
        ti = (anthropic_to_template(body) if rec["path"].startswith("/v1/messages")
              else openai_to_template(body))
        kw = {} if ti.enable_thinking is None else {"enable_thinking": ti.enable_thinking}
        want = hf_tok.apply_chat_template(ti.messages, tools=ti.tools, tokenize=False,
                                          add_generation_prompt=True, **kw)
        assert tok.render(ti.messages, ti.tools, ti.enable_thinking,
                          keep_all_reasoning=False) == want, name
    # ids equal transformers' tokenization of the same text (one large prompt suffices)
    ids = tok.encode(want)
    assert ids == hf_tok.encode(want, add_special_tokens=False)
    assert tok.decode(ids) == want


def test_keep_all_reasoning_is_append_only(tok: ChatTokenizer) -> None:
    """Each assistant turn, rendered later, equals what the prompt was plus what the model
    generated, so every prompt is a prefix of the next one."""
    conv = [m for m in CONV if m["role"] != "system" or m is CONV[0]]
    starts = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    for keep, expect_prefix in ((True, True), (False, False)):
        texts = [tok.render(conv[:i], TOOLS, keep_all_reasoning=keep) for i in starts]
        texts.append(tok.render(conv, TOOLS, add_generation_prompt=False,
                                keep_all_reasoning=keep))
        ok = all(b.startswith(a) for a, b in itertools.pairwise(texts))
        assert ok is expect_prefix
    full = tok.apply(conv, TOOLS, add_generation_prompt=False).text
    assert "<think>\nI should run ls.\n</think>\n\n<tool_call>" in full
    assert "<think>\nold style\n</think>\n\nYou're welcome." in full


# The generation prompt of the Qwen3.5/3.6 templates: reasoning is pre-opened unless disabled.
PREOPEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


def test_prompt_opens_reasoning(tok: ChatTokenizer, qwen_dir: Path, tmp_path: Path) -> None:
    """Both answers, on the rendered text: Qwen3's template never pre-opens `<think>`; a template
    that does (Qwen3.5/3.6) opens it unless thinking is off, which closes the block instead.
    Bug it catches: a parser started outside reasoning on a pre-opened prompt shows the model's
    reasoning as answer text."""
    msgs = [{"role": "user", "content": "hi"}]
    for thinking in (None, True, False):
        p = tok.apply(msgs, enable_thinking=thinking)
        assert not p.opens_reasoning and not p.text.rstrip().endswith("<think>")
    pre = ChatTokenizer.from_dir(_copy_dir(qwen_dir, tmp_path / "pre",
                                           {"chat_template": PREOPEN_TEMPLATE}))
    for thinking, opens in ((None, True), (True, True), (False, False)):
        p = pre.apply(msgs, enable_thinking=thinking)
        assert p.text.endswith("<think>\n\n</think>\n\n" if not opens else "<think>\n")
        assert p.opens_reasoning is opens


def _copy_dir(src: Path, dst: Path, config_edit: dict[str, Any] | None = None) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(config_edit or {})
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_generation_config_eos(qwen_dir: Path, tmp_path: Path) -> None:
    d = _copy_dir(qwen_dir, tmp_path / "a")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [151643, 151645]}))
    assert ChatTokenizer.from_dir(d).eos_token_ids == [151643, 151645]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
    assert ChatTokenizer.from_dir(d).eos_token_ids == [151643, 151645]


def test_template_file_fallback_and_missing(qwen_dir: Path, tmp_path: Path,
                                            tok: ChatTokenizer) -> None:
    d = _copy_dir(qwen_dir, tmp_path / "b", {"chat_template": None})
    with pytest.raises(ChatInputError):
        ChatTokenizer.from_dir(d).render([{"role": "user", "content": "x"}])
    assert tok.chat_template is not None
    (d / "chat_template.jinja").write_text(tok.chat_template)
    msgs = [{"role": "user", "content": "x"}]
    assert ChatTokenizer.from_dir(d).render(msgs) == tok.render(msgs)


def test_template_errors_become_chat_input_errors(tok: ChatTokenizer) -> None:
    with pytest.raises(ChatInputError):
        tok.render([{"role": "user", "content": ["not", "a", "string"]}])
