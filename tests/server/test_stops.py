"""StopMatcher against a plain oracle: after each chunk, the text so far cut before the
earliest stop that has completed."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.server.stops import StopMatcher


def oracle(chunks: list[str], stops: list[str]) -> tuple[str, str | None]:
    """Streaming semantics (as the OpenAI API and vLLM apply stops while tokens arrive): after
    each chunk, if any stop occurs in the text so far, the earliest-starting one (ties: list
    order) ends the output. A stop that completes in an earlier chunk wins over a longer one
    that would have started before it but completes later (chunks ['ca', 'a'], stops
    ['a', 'caa'] stop at 'a' — the whole-text view would pick 'caa')."""
    text = ""
    for c in chunks:
        text += c
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            i, s = min(hits, key=lambda h: (h[0], stops.index(h[1])))
            return text[:i], s
    return text, None


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
    want_text, want_hit = oracle(chunks, stops)
    assert out == want_text
    assert hit == want_hit
    assert delay <= max((len(s) for s in stops), default=1) - 1 or not stops


def test_overlapping_stops_first_completed_wins() -> None:
    """The Hypothesis case that told the two semantics apart (see `oracle`)."""
    assert run(["ca", "a"], ["a", "caa"])[:2] == ("c", "a")
    assert run(["caa"], ["a", "caa"])[:2] == ("", "caa")


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
