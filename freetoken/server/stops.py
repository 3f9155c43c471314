"""Stop strings matched in streamed text.

`StopMatcher.push(delta)` returns the text that is safe to emit and the stop string matched,
if any. It holds back only the longest tail of the text seen so far that is a prefix of some
stop string, so output is delayed by at most `max(len(stop)) - 1` characters and only while a
stop could still be forming. On a match, the text before the stop is returned and nothing after.
Among stops that complete in the same delta, the one that starts earliest wins.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.done = False

    def _hold_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, delta: str) -> tuple[str, str | None]:
        if self.done:
            return "", None
        if not self.stops:
            return delta, None
        text = self._held + delta
        first: tuple[int, str] | None = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.done = True
            self._held = ""
            return text[: first[0]], first[1]
        keep = self._hold_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Release held text (the stream ended, or a non-text event breaks the text run)."""
        out, self._held = self._held, ""
        return out
