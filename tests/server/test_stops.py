"""StopMatcher against a plain oracle: the whole text, cut before the earliest stop."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.server.stops import StopMatcher


def oracle(text: str, stops: list[str]) -> tuple[str, str | None]:
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    i, s = min(hits, key=lambda h: (h[0], stops.index(h[1])))
    return text[:i], s


def run(chunks: list[str], stops: list[str]) -> tuple[str, str | None, int]:
    m = StopMatcher(stops)
    out, hit, max_delay = "", None, 0
    seen = ""
    for c in chunks:
        seen += c
        emitted, hit = m.push(c)
        out += emitted
        if hit is not None:
            return out, hit, max_delay
        max_delay = max(max_delay, len(seen) - len(out))
    return out + m.flush(), None, max_delay


ALPHA = st.text(alphabet="abc\n", max_size=6)


@settings(max_examples=400, deadline=None)
@given(chunks=st.lists(ALPHA, max_size=12), stops=st.lists(ALPHA.filter(bool), max_size=3))
def test_matches_oracle(chunks: list[str], stops: list[str]) -> None:
    out, hit, delay = run(chunks, stops)
    want_text, want_hit = oracle("".join(chunks), stops)
    assert out == want_text
    assert (hit is None) == (want_hit is None)
    if hit is not None:
        assert "".join(chunks).find(hit) == len(want_text)
    assert delay <= max((len(s) for s in stops), default=1) - 1 or not stops


def test_holds_back_only_a_possible_prefix() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", None)
    assert m.push("x") == ("STx", None)
    assert m.push("foo STO") == ("foo ", None)
    assert m.push("P bar") == ("", "STOP")
    assert m.push("more") == ("", None)


def test_stop_spanning_three_chunks_and_unicode() -> None:
    m = StopMatcher(["</ans>", "é!"])
    assert m.push("x </") == ("x ", None)
    assert m.push("an") == ("", None)
    assert m.push("s>tail") == ("", "</ans>")
    m = StopMatcher(["é!"])
    assert m.push("café") == ("caf", None)
    assert m.push("!") == ("", "é!")
