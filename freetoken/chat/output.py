"""Streaming output parsing: token ids -> reasoning deltas, text deltas and tool calls.

The parser works on detokenized text, so it holds for families whose tags are several tokens.
Text that may be the start of a tag (`<`, `<too`, ...) is held back until the next text
decides it. Whitespace the template puts around blocks is not content: leading newlines of a
reasoning or text segment, and newlines right before `</think>` or `<tool_call>`, are dropped
(the Qwen templates re-add exactly these when the turn is sent back).

- Reasoning: `<think>...</think>`. The output starts inside reasoning when `thinking` and
  `starts_in_reasoning` (the prompt ended with an open `<think>`, see `Prompt.opens_reasoning`);
  otherwise a `<think>` before any content opens it (Qwen3 emits it itself).
- Tool calls: `<tool_call>BODY</tool_call>`, parsed by `tool_parsers` (JSON or XML, picked by
  the body; GLM's arg_key / arg_value body), also inside reasoning. DeepSeek and Kimi frame each
  call with their own tags (`tool_parsers.CALL_TAGS`) inside a section whose tags are dropped.
  A call that does not parse is passed on verbatim as a delta of the span it sits in (TextDelta
  in content, ReasoningDelta in reasoning); an unterminated call at `finish()` is parsed if
  complete, else passed on the same way. Nothing raises.
"""
from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from freetoken.chat.detok import IncrementalDetokenizer
from freetoken.chat.out_events import OutEvent, ReasoningDelta, TextDelta, ToolCall
from freetoken.chat.tool_parsers import CALL_TAGS, offered_name, parse_tool_call, tool_schemas
from freetoken.log import get_logger, kv

log = get_logger("chat")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# Family -> default tool-call body format when the body does not say (auto-detect first).
FAMILIES = {"qwen3": "json", "qwen3_moe": "json", "qwen3_next": "json", "qwen3_coder": "xml",
            "qwen3_5": "xml", "qwen3_5_moe": "xml", "qwen3_6": "xml", "glm_moe_dsa": "glm",
            "deepseek_v3": "deepseek", "kimi_linear": "kimi", "gpt_oss": "harmony"}
# Control tokens that end or frame a turn; never part of the answer text.
_CONTROL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")




class _Tok(Protocol):
    eos_token_ids: list[int]
    special_ids: dict[str, int]

    def decode(self, ids: Sequence[int]) -> str: ...


def _default_id(_index: int) -> str:
    return "call_" + secrets.token_hex(12)


def output_parser(tokenizer: _Tok, family: str = "qwen3", **kw: Any) -> Any:
    """The output parser of a response (`kw`: thinking, starts_in_reasoning, tools, id_factory):
    `HarmonyOutputParser` when the vocabulary is harmony's (as rendering decides: gpt-oss), else
    `OutputParser` of `family` (gpt_oss without a harmony vocabulary, e.g. a `ft bench
    checkpoint` shape over the Qwen3 tokenizer, renders and parses as qwen3)."""
    from freetoken.chat.harmony_anchors import HarmonyTokens

    if HarmonyTokens.from_vocab(tokenizer.special_ids) is not None:
        from freetoken.chat.harmony_output import HarmonyOutputParser

        return HarmonyOutputParser(tokenizer, **kw)
    if FAMILIES.get(family) == "harmony":
        family = "qwen3"
    return OutputParser(tokenizer, family=family, **kw)


class OutputParser:
    """One request's output stream. Feed `push(new_ids)` per engine event, then `finish()`."""

    def __init__(
        self,
        tokenizer: _Tok,
        family: str = "qwen3",
        thinking: bool = True,
        starts_in_reasoning: bool = False,
        tools: list[dict[str, Any]] | None = None,
        id_factory: Callable[[int], str] = _default_id,
    ) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown output family {family!r}; known: {sorted(FAMILIES)}")
        self._format = FAMILIES[family]
        if self._format == "harmony":
            raise ValueError("gpt_oss's output is harmony's: use chat.harmony_output."
                             "HarmonyOutputParser (chat.output_parser picks it)")
        self._open, self._close, self._section = CALL_TAGS[self._format]
        self._schemas = tool_schemas(tools)
        self._ids = id_factory
        self._detok = IncrementalDetokenizer(tokenizer)
        specials = tokenizer.special_ids
        framing = (*_CONTROL, *self._section)
        self._drop = set(tokenizer.eos_token_ids) | {specials[t] for t in framing
                                                     if t in specials}
        self._reasoning = thinking and starts_in_reasoning
        self._in_call = False
        self._call = ""  # text of the open call
        self._pending = ""  # possible start of a tag
        self._seg_start = True  # strip leading newlines of the segment
        self._held_nl = ""  # trailing newlines, dropped if a tag follows
        self._content_seen = False  # after this a `<think>` is plain text
        self.tool_calls = 0

    def push(self, token_ids: Sequence[int]) -> list[OutEvent]:
        ids = [t for t in token_ids if t not in self._drop]
        return self.push_text(self._detok.push(ids))

    def push_text(self, text: str) -> list[OutEvent]:
        """Feed already-detokenized text (what `push` does after detokenizing); a call
        section's tags in it are dropped (`push` drops their ids)."""
        events: list[OutEvent] = []
        self._feed(self._pending + text, events)
        return events

    def finish(self) -> list[OutEvent]:
        events: list[OutEvent] = []
        self._feed(self._pending + self._detok.flush(), events, final=True)
        if self._in_call:
            self._in_call = False
            self._close_call(self._call, events, terminated=False)
        if self._pending:
            self._emit(self._pending, events)
            self._pending = ""
        if self._held_nl:
            events.append(self._delta(self._held_nl))
            self._held_nl = ""
        return events

    # -- internals ---------------------------------------------------------------------------

    def _tags(self) -> tuple[str, ...]:
        if self._reasoning:
            return (THINK_CLOSE, self._open, *self._section)
        if self._content_seen:
            return (self._open, *self._section)
        return (self._open, THINK_OPEN, *self._section)

    def _feed(self, buf: str, events: list[OutEvent], final: bool = False) -> None:
        self._pending = ""
        while buf:
            if self._in_call:
                self._call += buf
                end = self._call.find(self._close)
                if end < 0:
                    return
                body, buf = self._call[:end], self._call[end + len(self._close) :]
                self._in_call, self._call = False, ""
                self._close_call(body, events, terminated=True)
                continue
            hits = [(i, t) for t in self._tags() if (i := buf.find(t)) >= 0
                    and (t != THINK_OPEN or not buf[:i].strip())]  # <think> only opens output
            if hits:
                i, tag = min(hits)
                self._emit(buf[:i], events)
                buf = buf[i + len(tag) :]
                if tag in self._section:  # framing only
                    self._held_nl = ""
                else:
                    self._open_tag(tag)
                continue
            hold = 0 if final else self._partial_tag_len(buf)
            self._emit(buf[: len(buf) - hold], events)
            self._pending = buf[len(buf) - hold :]
            return

    def _partial_tag_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a watched tag."""
        best = 0
        for tag in self._tags():
            for n in range(min(len(tag) - 1, len(buf)), best, -1):
                if buf.endswith(tag[:n]):
                    best = n
                    break
        return best

    def _open_tag(self, tag: str) -> None:
        self._held_nl = ""  # newlines before a tag are template layout
        if tag == self._open:
            self._in_call = True
            return
        self._reasoning = tag == THINK_OPEN
        self._content_seen = True  # after a think block, another <think> is plain text
        self._seg_start = True

    def _delta(self, text: str) -> OutEvent:
        return ReasoningDelta(text) if self._reasoning else TextDelta(text)

    def _emit(self, text: str, events: list[OutEvent]) -> None:
        if self._seg_start:
            text = text.lstrip("\n")
            if not text:
                return
            self._seg_start = False
        text = self._held_nl + text
        body = text.rstrip("\n")
        self._held_nl = text[len(body) :]
        if body:
            events.append(self._delta(body))
            if not self._reasoning and body.strip():
                self._content_seen = True

    def _close_call(self, body: str, events: list[OutEvent], terminated: bool) -> None:
        parsed = parse_tool_call(body, self._format, self._schemas)
        if parsed is None:
            log.debug(kv("tool_call_malformed", chars=len(body), terminated=terminated))
            raw = self._open + body + (self._close if terminated else "")
            events.append(self._delta(raw))
            if not self._reasoning:
                self._content_seen = True
        else:
            name, args = parsed
            name, why = offered_name(name, self._schemas)
            if why is not None:
                log.info(kv("tool_call_name", name=name, wrote=parsed[0], why=why))
            events.append(ToolCall(self.tool_calls, self._ids(self.tool_calls), name, args))
            self.tool_calls += 1
        self._seg_start = True
