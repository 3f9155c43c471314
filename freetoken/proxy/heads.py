"""`system_block` anchors: the adapters' head breaks (character offsets into the system text,
`HarnessAdapter.head_breaks`) turned into token positions of a rendered prompt.

A break at character `c` becomes the position `p` where the prompt's tokens stop being those of
`system[:c]`. The template renders the system text verbatim, so the tokens of the text just
before `c` (a window of `window` characters) are found in the prompt, less their first tokens
(the window starts mid-word; at the start of the text, the first token may merge with the
template's preamble) and their last (it may merge with what follows `c`: Qwen's pre-tokenizer
glues newlines to punctuation); `p` is where they end. So `ids[:p]` is the same for every prompt
whose system text starts with `system[:c]`, and a state snapshot at `p` serves them all. A
break not found (the template changed the text, control-token escaping), closer than
`min_start` tokens to the start or `min_tokens` to the break before it gives no anchor: a
snapshot there would save less than it costs. (`min_start` is lower: OpenClaw's announce turn
drops a tool line ~540 characters, ~130 tokens, into its system text (#23); a head snapshot
there is shared by every session of the harness, and the previous one is the zero state.)

Only the window is tokenized (a 36k-character prefix took as long as rendering the whole
prompt), and its tokens are kept (`cache` windows, LRU): a session's system text does not
change between its requests, so later requests only search.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from freetoken.log import get_logger, kv
from freetoken.types.api import Anchor

log = get_logger("proxy")
KIND = "system_block"


def _find(hay: bytes, needle: bytes, width: int) -> int:
    """Index (in items of `width` bytes) of `needle` in `hay`, aligned; -1 if absent."""
    i = hay.find(needle)
    while i >= 0 and i % width:
        i = hay.find(needle, i + 1)
    return -1 if i < 0 else i // width


class HeadBreaks:
    def __init__(self, tokenizer: Any, min_tokens: int = 256, cache: int = 64,
                 window: int = 2048, min_start: int = 64) -> None:
        self.tok, self.min_tokens, self.size, self.window = tokenizer, min_tokens, cache, window
        self.min_start = min_start
        self._ids: OrderedDict[bytes, array] = OrderedDict()

    def _prefix_ids(self, text: str) -> array:
        key = hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = array("i", self.tok.encode(text))
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(key)
        return got

    def positions(self, system: str, breaks: Sequence[int], ids: Sequence[int]) -> list[int]:
        """Token positions in `ids` of the character offsets `breaks` into `system`."""
        if not breaks or not system:
            return []
        hay: bytes | None = None
        out: list[int] = []
        for c in breaks:
            lo = max(0, c - self.window)
            x = self._prefix_ids(system[lo:c])
            core = x[(1 if lo == 0 else 4):-1]
            if len(core) < 8:  # too little to find it by
                continue
            if hay is None:
                hay = array("i", ids).tobytes()
            start = _find(hay, core.tobytes(), core.itemsize)
            if start < 0:
                log.debug(kv("system_block_missing", chars=c, tokens=len(x)))
                continue
            p = start + len(core)
            if p >= self.min_start and (not out or p - out[-1] >= self.min_tokens):
                out.append(p)
        return out

    def anchors(self, anchors: Sequence[Anchor], system: str, breaks: Sequence[int],
                ids: Sequence[int]) -> list[Anchor]:
        """`anchors` with a `system_block` anchor at each break position that has none."""
        have = {a.position for a in anchors}
        new = [Anchor(p, KIND) for p in self.positions(system, breaks, ids) if p not in have]
        if not new:
            return list(anchors)
        return sorted([*anchors, *new], key=lambda a: a.position)  # stable: ties keep order
