"""Semantic anchors of the harmony format (gpt-oss), found on token ids.

Harmony has no per-block tags like `<think>`: every message is
`<|start|>{role}[ to={recipient}]<|channel|>{channel}[ to={recipient}][ {content type}]
<|message|>{content}<|end|>` (a tool call ends with `<|call|>`, the final answer with
`<|return|>`). The role and channel are ordinary tokens of the header between `<|start|>` and
`<|message|>`, so the detector decodes each header (a few tokens) and marks, as
chat/anchors.py does for Qwen (positions are the token that opens or closes the block):

- `turn_start(role)`: each `<|start|>`; a message from a tool (`functions.NAME to=assistant`)
  is role `tool`;
- `head_end`: the first `<|start|>` after the leading system (and developer: instructions and
  tool definitions) messages, when the prompt starts with a system message;
- `think_start` / `think_end`: the `<|channel|>` of an assistant `analysis` message / its
  closing `<|end|>`;
- `tool_call_start`: the `<|channel|>` (or `<|message|>`) of an assistant message addressed
  `to=` a tool;
- `tool_result_start` / `tool_result_end`: a tool message's `<|start|>` / its `<|end|>`.

Token ids of the released vocabulary (o200k_harmony): `<|start|>` 200006, `<|channel|>`
200005, `<|message|>` 200008, `<|end|>` 200007, `<|call|>` 200012, `<|return|>` 200002; the
detector reads them from the tokenizer's added tokens, whatever their ids.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from freetoken.types.api import Anchor

_NAMES = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
_PLAIN_ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class HarmonyTokens:
    start: int
    channel: int
    message: int
    end: int
    call: int | None = None
    ret: int | None = None

    @classmethod
    def from_vocab(cls, special_ids: dict[str, int]) -> HarmonyTokens | None:
        """From `{token text: id}` of the added tokens; None when the vocabulary is not
        harmony's (no `<|start|>`, `<|channel|>`, `<|message|>` and `<|end|>`)."""
        ids = [special_ids.get(n) for n in _NAMES]
        if any(i is None for i in ids[:4]):
            return None
        return cls(*ids)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Header:
    role: str  # system, developer, user, assistant, tool
    channel: str | None
    recipient: str | None
    channel_pos: int | None  # index of the header's <|channel|>


def parse_header(text_role: str, text_channel: str | None, channel_pos: int | None) -> Header:
    """A message header from its decoded parts: before `<|channel|>` and after it."""
    words = text_role.split()
    author = words[0] if words else ""
    recipient = None
    for part in (words[1:], (text_channel or "").split()):
        for w in part:
            if w.startswith("to="):
                recipient = w[3:]
    role = author if author in _PLAIN_ROLES else "tool"
    channel = (text_channel or "").split()[0] if text_channel and text_channel.split() else None
    return Header(role, channel, recipient if role == "assistant" else None, channel_pos)


def detect_harmony_anchors(ids: Sequence[int], tok: HarmonyTokens,
                           decode: Callable[[list[int]], str]) -> list[Anchor]:
    """Anchors of `ids` in position order (module docstring); `decode` turns a header's
    ordinary tokens back into text."""
    anchors: list[Anchor] = []
    closers = {tok.end, tok.call, tok.ret} - {None}
    first: str | None = None
    head_done = False
    pos, n = 0, len(ids)
    while pos < n:
        if ids[pos] != tok.start:
            pos += 1
            continue
        start = pos
        m = start + 1
        while m < n and ids[m] not in (tok.message, tok.start):
            m += 1
        header_ids = list(ids[start + 1:m])
        ch = next((start + 1 + i for i, t in enumerate(header_ids) if t == tok.channel), None)
        role_ids = header_ids if ch is None else header_ids[:ch - start - 1]
        chan_ids = None if ch is None else header_ids[ch - start:]
        h = parse_header(decode(role_ids), None if chan_ids is None else decode(chan_ids), ch)
        if first is None:
            first = h.role
        elif not head_done and h.role not in ("system", "developer"):
            head_done = True
            if first == "system":
                anchors.append(Anchor(start, "head_end"))
        anchors.append(Anchor(start, "turn_start", role=h.role))
        if h.role == "tool":
            anchors.append(Anchor(start, "tool_result_start"))
        elif h.role == "assistant" and h.recipient is not None:
            anchors.append(Anchor(ch if ch is not None else m, "tool_call_start"))
        elif h.role == "assistant" and h.channel == "analysis" and ch is not None:
            anchors.append(Anchor(ch, "think_start"))
        close = m + 1
        while close < n and ids[close] not in closers and ids[close] != tok.start:
            close += 1
        if close < n and ids[close] in closers:
            if h.role == "tool":
                anchors.append(Anchor(close, "tool_result_end"))
            elif h.role == "assistant" and h.channel == "analysis" and h.recipient is None:
                anchors.append(Anchor(close, "think_end"))
        pos = close if close > start else start + 1
    return anchors
