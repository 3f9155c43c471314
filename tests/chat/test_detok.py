"""IncrementalDetokenizer against one full decode of the same ids."""
from __future__ import annotations

import random

from freetoken.chat import ChatTokenizer, IncrementalDetokenizer

TEXTS = ["Hello, 世界! 🎉🚀 naïve café — 東京タワーは高い。", "😀" * 7 + "\n\n  中文测试 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
         "<think>\n推理 🤔\n</think>\n\n答案<tool_call>{\"k\": \"値\"}</tool_call>"]


def _run(tok: ChatTokenizer, ids: list[int], rng: random.Random) -> list[str]:
    d = IncrementalDetokenizer(tok)
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 7])
        out.append(d.push(ids[i : i + n]))
        i += n
    out.append(d.flush())
    return out


def test_multibyte_text_never_emits_broken_characters(tok: ChatTokenizer) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text)
        assert len(ids) > 10
        for _ in range(20):
            chunks = _run(tok, ids, rng)
            assert "".join(chunks) == tok.decode(ids) == text
            assert not any("\ufffd" in c for c in chunks)


def test_random_ids_concatenate_to_full_decode(tok: ChatTokenizer) -> None:
    rng = random.Random(1)
    # byte-level pieces that are fragments of multi-byte characters make the hard cases
    fragments = [i for i in range(tok.vocab_size)
                 if "\ufffd" in tok.decode([i])][:400]
    assert len(fragments) > 100
    for _ in range(200):
        n = rng.randint(1, 40)
        ids = [rng.choice(fragments) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
               for _ in range(n)]
        assert "".join(_run(tok, ids, rng)) == tok.decode(ids)


def test_holds_back_until_character_completes(tok: ChatTokenizer) -> None:
    ids = tok.encode("𝔘")
    assert len(ids) >= 2  # the character is split over several byte-level tokens
    d = IncrementalDetokenizer(tok)
    assert [d.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "𝔘"
    assert d.flush() == ""
