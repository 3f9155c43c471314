"""Anchors of the harmony format (gpt-oss; freetoken/chat/harmony_anchors.py) on token ids.

No gpt-oss tokenizer is available offline, so the vocabulary here is a word-level stand-in with
harmony's special tokens added (the detector reads their ids from the added tokens, whatever
they are); the prompt is what `ChatTokenizer` renders for a harmony vocabulary
(freetoken/chat/harmony.py): system and developer head, a user turn, an analysis message, a tool
call to `functions.get_weather`, its result, and the generation prompt; a final answer in a
second conversation. Each anchor is checked at the exact token the format puts it on."""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers

from freetoken.chat.harmony_anchors import HarmonyTokens, detect_harmony_anchors
from freetoken.chat.tokenizer import ChatTokenizer

SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
           "<|constrain|>"]
_TEXT = ("system developer user assistant analysis commentary final json "
         "to=functions.get_weather functions.get_weather to=assistant You are helpful. "
         "Weather? Need the tool. It is 20 degrees. # Tools")
WORDS = [*_TEXT.split(), '{"city":', '"Paris"}', '"{\\"temp\\":20}"']


def _tokenizer() -> ChatTokenizer:
    vocab = {w: i for i, w in enumerate(["[UNK]", *dict.fromkeys(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    return ChatTokenizer(tok, None, {}, [])


MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\":20}"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather?",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


def _positions(ids: list[int], sid: dict[str, int], name: str) -> list[int]:
    return [i for i, t in enumerate(ids) if t == sid[name]]


def test_anchors_sit_on_the_message_boundaries() -> None:
    ct = _tokenizer()
    assert ct.harmony is not None
    p = ct.apply(MESSAGES, tools=TOOLS)
    ids, sid = p.input_ids, ct.special_ids
    starts, chans = _positions(ids, sid, "<|start|>"), _positions(ids, sid, "<|channel|>")
    ends = _positions(ids, sid, "<|end|>")
    got = [(a.position, a.kind, a.role) for a in p.anchors if a.kind != "tool_def"]
    assert [a.role for a in p.anchors if a.kind == "tool_def"] == ["get_weather"]
    # messages: 0 system, 1 developer, 2 user, 3 analysis, 4 call, 5 tool, 6 prompt
    roles = ["system", "developer", "user", "assistant", "assistant", "tool", "assistant"]
    assert len(starts) == len(roles) and len(chans) == 3, p.text
    want = [(s, "turn_start", r) for s, r in zip(starts, roles)]
    want.append((starts[2], "head_end", None))
    want += [(chans[0], "think_start", None), (ends[3], "think_end", None)]
    want.append((chans[1], "tool_call_start", None))
    want += [(starts[5], "tool_result_start", None), (ends[4], "tool_result_end", None)]
    assert sorted(got, key=lambda a: (a[0], a[1])) == sorted(want, key=lambda a: (a[0], a[1]))
    # every anchor is a token boundary the format defines: a header's <|start|>, a
    # <|channel|> or a message's closing token
    assert {a for a, *_ in got} <= set(starts) | set(chans) | set(ends)


def test_final_answer_drops_the_calls_analysis() -> None:
    """A later final answer: the call's analysis is not rendered (as the official template),
    so no think anchors; the final message is an assistant turn."""
    ct = _tokenizer()
    p = ct.apply([*MESSAGES, {"role": "assistant", "content": "It is 20 degrees."}],
                 tools=TOOLS)
    kinds = [a.kind for a in p.anchors]
    assert "think_start" not in kinds and kinds.count("tool_call_start") == 1
    roles = [a.role for a in p.anchors if a.kind == "turn_start"]
    assert roles == ["system", "developer", "user", "assistant", "tool", "assistant",
                     "assistant"]


def test_no_head_end_without_a_leading_system_message() -> None:
    ct = _tokenizer()
    ids = ct.encode("<|start|>user<|message|>Weather?<|end|><|start|>assistant<|channel|>"
                    "final<|message|>It is 20 degrees.<|return|>")
    a = detect_harmony_anchors(ids, ct.harmony, ct.decode)
    assert [x.kind for x in a] == ["turn_start", "turn_start"]
    assert [x.role for x in a] == ["user", "assistant"]


def test_qwen_vocabulary_is_not_harmony() -> None:
    assert HarmonyTokens.from_vocab({"<|im_start|>": 1, "<|im_end|>": 2}) is None
