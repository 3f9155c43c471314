"""A harmony vocabulary for the gpt-oss chat tests: the real Qwen3 byte-level BPE (o200k_harmony
is a download) with harmony's control tokens added as special tokens, and a way to write text as
one token per UTF-8 byte (every token boundary then is a byte boundary, also inside a
character)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer

from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir

HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
                    "<|return|>", "<|constrain|>"]


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def harmony_tokenizer_json() -> Tokenizer:
    tok = Tokenizer.from_file(str(qwen3_tokenizer_dir() / "tokenizer.json"))
    tok.add_special_tokens(HARMONY_SPECIALS)
    return tok


def harmony_tokenizer() -> ChatTokenizer:
    tok = harmony_tokenizer_json()
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    return ChatTokenizer(tok, None, {}, stops)


def write_harmony_tokenizer(out: Path) -> list[int]:
    """tokenizer.json (+ a config without a chat template) and generation_config.json with
    harmony's stop tokens in `out`; returns the stop ids."""
    tok = harmony_tokenizer_json()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return stops


@functools.lru_cache(maxsize=1)
def _vocab() -> dict[str, int]:
    return harmony_tokenizer_json().get_vocab()


def byte_ids(ct: ChatTokenizer, text: str) -> list[int]:
    """`text` as token ids, harmony's control tokens as theirs and every other UTF-8 byte as its
    own byte token (decodes back to `text`)."""
    chars = _byte_chars()
    ids: list[int] = []
    i = 0
    while i < len(text):
        tag = next((s for s in HARMONY_SPECIALS if text.startswith(s, i)), None)
        if tag is not None:
            ids.append(ct.special_ids[tag])
            i += len(tag)
            continue
        ids += [_vocab()[chars[b]] for b in text[i].encode("utf-8")]
        i += 1
    return ids
