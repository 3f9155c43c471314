"""DeepSeek-V3's chat template (tests/data/chat_templates/deepseek_v3.jinja) rendered by our
ChatTokenizer exactly as transformers' `apply_chat_template` renders it, for conversations with
system prompts and tool outputs. Its assistant tool-call turns need `content` null, which
transformers 5 drops before rendering (as we do), so the template's `message['content'] is none`
then fails: both refuse such a conversation (ours as a ChatInputError, a 400), and DeepSeek tool
calls cannot be rendered from history with this template. The tokenizer here is a stand-in
holding DeepSeek's special tokens only (the real `tokenizer.json` is not shipped): rendering
reads the template and the special-token variables, not the vocabulary."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models

from freetoken.chat import ChatTokenizer

TEMPLATE = (Path(__file__).parents[1] / "data" / "chat_templates" / "deepseek_v3.jinja").read_text()
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIALS = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>"]
CALL = {"type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
CONV: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "system", "content": "Second system part."},
    {"role": "user", "content": "List files."},
    {"role": "assistant", "content": "Running ls."},
    {"role": "tool", "content": "a.txt\nb.txt"},
    {"role": "tool", "content": "c.txt"},
    {"role": "assistant", "content": "Three files."},
    {"role": "user", "content": "\u4e2d\u6587, thanks."},
]


def _stand_in() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


@pytest.fixture(scope="module")
def pair() -> tuple[ChatTokenizer, Any]:
    transformers = pytest.importorskip("transformers")
    ours = ChatTokenizer(_stand_in(), TEMPLATE, {"bos_token": BOS, "eos_token": EOS}, [1])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_stand_in(), bos_token=BOS,
                                              eos_token=EOS)
    hf.chat_template = TEMPLATE
    return ours, hf


@pytest.mark.parametrize("cut", range(1, len(CONV) + 1))
@pytest.mark.parametrize("agp", [True, False])
def test_render_matches_transformers(pair, cut: int, agp: bool) -> None:
    ours, hf = pair
    msgs = CONV[:cut]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
    assert ours.render(msgs, None, None, agp) == want
    assert want.startswith(BOS)


def test_tool_outputs_and_refused_tool_call_turns(pair) -> None:
    from freetoken.chat import ChatInputError

    ours, hf = pair
    text = ours.render(CONV[:6], None, None, True)
    assert text.endswith("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>a.txt\nb.txt"
                         "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>c.txt<｜tool▁output▁end｜>"
                         "<｜tool▁outputs▁end｜>")
    call_turn = CONV[:3] + [{"role": "assistant", "content": None, "tool_calls": [CALL]}]
    with pytest.raises(Exception, match="content"):
        hf.apply_chat_template(call_turn, tokenize=False)
    with pytest.raises(ChatInputError):
        ours.render(call_turn, None, None, True)
