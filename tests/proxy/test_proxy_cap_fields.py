"""The proxy's output cap lowers every field bounded by the output limit (#23 item 6).

Bug it catches: the cap lowered `max_tokens` but left `min_tokens` above it, so the engine's
validation answered HTTP 400 ("min_tokens exceeds max_tokens") on 4 of 13 W4 turns."""
from __future__ import annotations

from freetoken.proxy.app import _apply_cap
from freetoken.server.validation import common_params


def test_cap_lowers_min_tokens_so_the_engine_accepts_the_body() -> None:
    body = {"max_tokens": 4000, "min_tokens": 3000}
    assert _apply_cap(body, "openai", 1000) == (4000, 1000)
    assert body == {"max_tokens": 1000, "min_tokens": 1000}
    p = common_params(body, ("max_completion_tokens", "max_tokens"), "stop")  # no 400
    assert (p.max_tokens, p.min_tokens) == (1000, 1000)


def test_cap_keeps_min_tokens_below_it_and_lowers_anthropic_thinking_budget() -> None:
    body = {"max_tokens": 64000, "min_tokens": 10,
            "thinking": {"type": "enabled", "budget_tokens": 32000}}
    assert _apply_cap(body, "anthropic", 2048) == (64000, 2048)
    assert body["min_tokens"] == 10 and body["max_tokens"] == 2048
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2047}


def test_no_cap_leaves_the_body_alone() -> None:
    body = {"max_tokens": 100, "min_tokens": 90}
    assert _apply_cap(body, "openai", 1000) == (100, None)
    assert body == {"max_tokens": 100, "min_tokens": 90}
