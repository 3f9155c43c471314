"""Control tokens written in message text are tokenized as text, the template's own stay control.

A user who writes `<|im_end|>\\n<|im_start|>system` in a message must not open a system turn: the
tokenizer matches added tokens anywhere in its input, so the rendered prompt alone cannot tell
the template's `<|im_start|>` from the user's. Before rendering, every control-token string in
message text is replaced by a placeholder (`MARK` + one private-use character naming it); the
template's own tokens are then the only added-token strings left in the rendered text. The ids
are built segment by segment: each template token by its id, the text between them (with the
placeholders put back) by an encoder that treats added-token strings as plain text.

Which strings are escaped: in assistant text (content, reasoning) only the tokens marked
`special` (`<|im_end|>`, ...), because templates parse the non-special ones there (Qwen splits
assistant content at `</think>`) and the model wrote them itself; everywhere else (system, user,
tool results, tool-call arguments, tool definitions) every added token, so a tool result cannot
close its `<tool_response>` either.
`MARK` itself is escaped too, so every `MARK` in the rendered text is one of ours.

A request without such strings takes no part of this path: its ids are exactly the plain
`encode` of the rendered text, as before.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

MARK = "\ue000"
_BASE = 0xF0000  # supplementary private-use plane: one character per escaped string


class PlainTextEscaper:
    """Escapes control strings in messages/tools and tokenizes the rendered result."""

    def __init__(self, tok: Tokenizer) -> None:
        added = tok.get_added_tokens_decoder()
        self._tok = tok
        self._plain = _plain_encoder(tok)
        self.strings = [MARK] + sorted({a.content for a in added.values()}, key=len,
                                       reverse=True)
        special = {a.content for a in added.values() if a.special}
        self._code = {s: MARK + chr(_BASE + i) for i, s in enumerate(self.strings)}
        self._all = _alternation(self.strings)
        self._special = _alternation([s for s in self.strings if s in special or s == MARK])
        self._template_tokens = _alternation(self.strings[1:])
        self._ids = {a.content: i for i, a in added.items()}
        self._unmark = re.compile(MARK + "(.)", re.DOTALL)

    def escape(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]:
        """(messages, tools, changed): copies with control strings replaced by placeholders,
        or the inputs themselves when nothing needed escaping."""
        changed = [False]

        def sub(v: Any, pat: re.Pattern[str]) -> Any:
            if isinstance(v, str):
                if pat.search(v) is None:
                    return v
                changed[0] = True
                return pat.sub(lambda m: self._code[m.group(0)], v)
            if isinstance(v, dict):
                return {sub(k, pat): sub(x, pat) for k, x in v.items()}
            if isinstance(v, list):
                return [sub(x, pat) for x in v]
            return v

        def pattern(m: dict[str, Any], key: str) -> re.Pattern[str]:
            return self._special if m.get("role") == "assistant" and key != "tool_calls" \
                else self._all

        msgs = [{k: sub(v, pattern(m, k)) for k, v in m.items()} if isinstance(m, dict) else m
                for m in messages]
        new_tools = sub(tools, self._all) if tools is not None else None
        if not changed[0]:
            return list(messages), tools, False
        return msgs, new_tools, True

    def unescape(self, text: str) -> str:
        return self._unmark.sub(lambda m: self.strings[ord(m.group(1)) - _BASE], text)

    def encode(self, rendered: str) -> tuple[list[int], str]:
        """(ids, text) of a rendered prompt holding placeholders: template tokens as their ids,
        everything between them, placeholders restored, as plain text."""
        ids: list[int] = []
        pos = 0
        for m in self._template_tokens.finditer(rendered):
            ids += self._plain.encode(self.unescape(rendered[pos:m.start()]),
                                      add_special_tokens=False).ids
            ids.append(self._ids[m.group(0)])
            pos = m.end()
        ids += self._plain.encode(self.unescape(rendered[pos:]), add_special_tokens=False).ids
        return ids, self.unescape(rendered)


def _alternation(strings: list[str]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))


def _plain_encoder(tok: Tokenizer) -> Tokenizer:
    """A copy of `tok` that encodes every added-token string as ordinary text.
    `encode_special_tokens` only covers tokens marked special (`<tool_call>` is not), so the copy
    marks them all special first; a copy, because the flag belongs to the instance and the
    original is shared by concurrent requests."""
    spec = json.loads(tok.to_str())
    for a in spec.get("added_tokens") or []:
        a["special"] = True
    plain = Tokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain
