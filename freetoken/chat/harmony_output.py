"""Streaming output parsing of the harmony format (gpt-oss): token ids -> reasoning deltas, text
deltas and tool calls (the events of `freetoken.chat.output`, so both APIs and the Responses
items map them as every family's).

The prompt ends with the generation prompt `<|start|>assistant`, so the output starts inside a
message header. Each message is `{header}<|message|>{body}` closed by `<|end|>` (the model goes
on with `<|start|>` and the next header), `<|call|>` (a tool call: a stop token) or `<|return|>`
(the final answer: a stop token). The parser works on token ids: harmony's control tokens are
single added tokens, so a header or a body ends exactly at one. The header (`[role][ to=R]
<|channel|>CHANNEL[ to=R][ <|constrain|>TYPE]`, the recipient on either side) picks the
body's kind:

- channel `analysis` -> `ReasoningDelta`s (thinking blocks / `reasoning_content` / reasoning
  items), streamed as the body decodes;
- a recipient (`to=functions.NAME`, on the commentary channel) -> one `ToolCall` (name without
  `functions.`, the body's JSON object as its arguments) when the message closes; a body that is
  not a JSON object is passed on verbatim as a `TextDelta` (nothing raises);
- `final`, and `commentary` without a recipient (a preamble the user sees) -> `TextDelta`s.

Bodies are text as the model wrote it (harmony puts no layout whitespace around them). A header
the model never closes is held until `<|message|>`; past `MAX_HEADER` tokens (no header is that
long) its text is passed on as answer text, and at `finish()` a held header without a
`<|channel|>` is passed on as text, one with it dropped (a message cut before its body).
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from freetoken.chat.detok import IncrementalDetokenizer
from freetoken.chat.harmony_anchors import HarmonyTokens
from freetoken.chat.out_events import OutEvent, ReasoningDelta, TextDelta, ToolCall
from freetoken.chat.tool_parsers import offered_name, tool_schemas
from freetoken.log import get_logger, kv

log = get_logger("chat")

MAX_HEADER = 64  # tokens; the longest real header (`to=functions.NAME ...`) is a few dozen


@dataclass(frozen=True)
class MessageHeader:
    role: str
    channel: str | None
    recipient: str | None  # `functions.get_weather`, or None
    content_type: str | None  # `json`, or None


def parse_output_header(text: str) -> MessageHeader:
    """A header's decoded text (control tokens as their text) -> its parts; the role defaults
    to assistant (the generation prompt wrote it)."""
    text = text.replace("<|constrain|>", " ")
    role_part, _, chan_part = text.partition("<|channel|>")
    recipient = None
    for w in (role_part + " " + chan_part).split():
        if w.startswith("to="):
            recipient = w[3:] or None
    words = [w for w in role_part.split() if not w.startswith("to=")]
    rest = [w for w in chan_part.split() if not w.startswith("to=")]
    channel = rest[0] if rest else None
    ctype = rest[1] if len(rest) > 1 else None
    return MessageHeader(words[0] if words else "assistant", channel, recipient, ctype)


def _default_id(_index: int) -> str:
    return "call_" + secrets.token_hex(12)


class HarmonyOutputParser:
    """One request's output stream (same contract as `OutputParser`): `push(new_ids)` per engine
    event, then `finish()`; `tool_calls` counts the calls emitted. `thinking` and
    `starts_in_reasoning` are accepted for the common signature: harmony's channels say what is
    reasoning."""

    def __init__(self, tokenizer: Any, thinking: bool = True, starts_in_reasoning: bool = False,
                 tools: list[dict[str, Any]] | None = None,
                 id_factory: Callable[[int], str] = _default_id) -> None:
        tok = HarmonyTokens.from_vocab(tokenizer.special_ids)
        if tok is None:
            raise ValueError("the tokenizer has no harmony vocabulary (<|start|>, <|channel|>, "
                             "<|message|>, <|end|>)")
        self._tokenizer, self._t, self._ids = tokenizer, tok, id_factory
        self._offered = tool_schemas(tools)
        self._closers = ({tok.end, tok.call, tok.ret} | set(tokenizer.eos_token_ids)) - {None}
        self._header: list[int] = []  # the open header's ids
        self._in_body = False
        self._head: MessageHeader | None = None
        self._detok = IncrementalDetokenizer(tokenizer)
        self._call = ""  # the open tool call's body
        self.tool_calls = 0

    def push(self, token_ids: Sequence[int]) -> list[OutEvent]:
        events: list[OutEvent] = []
        t = self._t
        for tid in token_ids:
            if self._in_body:
                if tid in self._closers or tid == t.start:
                    self._close(events, terminated=tid in self._closers)
                    continue  # a <|start|> opens the next header, which is empty anyway
                self._body_text(self._detok.push([tid]), events)
            elif tid == t.message:
                self._open_body()
            elif tid == t.start or tid in self._closers:
                self._header = []  # a new header, or a message closed before its body
            else:
                self._header.append(tid)
                if len(self._header) > MAX_HEADER:  # not a header: answer text
                    log.debug(kv("harmony_header_overflow", tokens=len(self._header)))
                    held, self._header = self._header, []
                    self._head, self._in_body = MessageHeader("assistant", None, None, None), True
                    self._detok = IncrementalDetokenizer(self._tokenizer)
                    self._body_text(self._detok.push(held), events)
        return events

    def finish(self) -> list[OutEvent]:
        events: list[OutEvent] = []
        if self._in_body:
            self._close(events, terminated=False)
        elif self._header:
            text = self._tokenizer.decode(self._header)
            if "<|channel|>" not in text and text.strip():
                events.append(TextDelta(text))
            self._header = []
        return events

    # -- internals ---------------------------------------------------------------------------

    def _open_body(self) -> None:
        self._head = parse_output_header(self._tokenizer.decode(self._header))
        self._header, self._in_body, self._call = [], True, ""
        self._detok = IncrementalDetokenizer(self._tokenizer)

    def _body_text(self, text: str, events: list[OutEvent]) -> None:
        h = self._head
        if not text or h is None:
            return
        if h.recipient is not None:
            self._call += text
        elif h.channel == "analysis":
            events.append(ReasoningDelta(text))
        else:
            events.append(TextDelta(text))

    def _close(self, events: list[OutEvent], terminated: bool) -> None:
        self._body_text(self._detok.flush(), events)
        h, self._in_body, self._head = self._head, False, None
        if h is not None and h.recipient is not None:
            self._emit_call(h.recipient, self._call, events, terminated)
        self._call = ""

    def _emit_call(self, recipient: str, body: str, events: list[OutEvent],
                   terminated: bool) -> None:
        name = recipient.removeprefix("functions.")
        try:
            args = json.loads(body) if body.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            args = None
        if not isinstance(args, dict) or not name:
            log.debug(kv("tool_call_malformed", chars=len(body), terminated=terminated))
            if body:
                events.append(TextDelta(body))
            return
        name, why = offered_name(name, self._offered)
        if why is not None:
            log.info(kv("tool_call_name", name=name, wrote=recipient, why=why))
        events.append(ToolCall(self.tool_calls, self._ids(self.tool_calls), name,
                               json.dumps(args, ensure_ascii=False)))
        self.tool_calls += 1
