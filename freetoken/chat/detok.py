"""Incremental detokenization that never emits a broken UTF-8 sequence.

Byte-level tokens can end in the middle of a character; decoding such a prefix yields U+FFFD.
We decode a short window `ids[prefix:]` and emit only the part past `ids[prefix:read]`, and
hold text back while it ends in U+FFFD (the next token may complete the character). Decoding
from `prefix` (a point already emitted) rather than from `read` keeps decoders that treat the
first token specially (SentencePiece's leading space) exact. Contract: the concatenation of
every `push` and the final `flush` equals `tokenizer.decode(all_ids)`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: a token boundary where the emitted text was complete
        self._read = 0  # everything decoded from ids[:_read] has been emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self._ids.extend(token_ids)
        if len(self._ids) == self._read:
            return ""
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if text.endswith("\ufffd") or len(text) <= len(done) or not text.startswith(done):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Everything still held back (a trailing U+FFFD stays a U+FFFD)."""
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text.removeprefix(done)
