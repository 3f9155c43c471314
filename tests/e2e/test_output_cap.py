"""The server's own output cap (`ft serve --max-output-tokens`, 256 by default for the demo
model) against the real engine. Regression: `claude -p hi` against `ft serve` asked for 64,000
tokens of a demo model that never ends its reply and hung for minutes; and a reply stopped by
a cap must read as a normal end of turn (Claude Code turns a `max_tokens` stop into an error)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from freetoken.server.generation import DEMO_OUTPUT_CAP, default_output_cap

MSGS = [{"role": "user", "content": "write a very long story"}]


def _sse_json(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")]


@pytest.fixture()
def capped(live):
    server, engine = live
    engine.max_output_tokens = 5
    try:
        yield server
    finally:
        engine.max_output_tokens = None


def test_cap_ends_anthropic_reply_as_end_of_turn(capped) -> None:
    with httpx.Client(base_url=capped.url, timeout=120) as c:
        r = c.post("/v1/messages", json={"model": "x", "max_tokens": 64000, "messages": MSGS})
        assert r.status_code == 200 and r.headers["x-ft-output-cap"] == "5"
        out = r.json()
        assert out["stop_reason"] == "end_turn" and out["usage"]["output_tokens"] == 5
        r = c.post("/v1/messages", json={"model": "x", "max_tokens": 64000, "messages": MSGS,
                                         "stream": True})
        evs = _sse_json(r.text)
        delta = [e for e in evs if e["type"] == "message_delta"]
        assert delta[-1]["delta"]["stop_reason"] == "end_turn"
        assert delta[-1]["usage"]["output_tokens"] == 5


def test_cap_ends_openai_reply_as_stop(capped) -> None:
    with httpx.Client(base_url=capped.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"model": "x", "messages": MSGS})  # no limit
        assert r.headers["x-ft-output-cap"] == "5"
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] == 5
        r = c.post("/v1/chat/completions", json={"model": "x", "messages": MSGS, "stream": True,
                                                 "max_tokens": 32000})
        fins = [ch["finish_reason"] for e in _sse_json(r.text) for ch in e.get("choices", [])
                if ch.get("finish_reason")]
        assert fins == ["stop"]


def test_client_limit_below_cap_is_reported_as_is(capped) -> None:
    """The client's own limit reached is its `max_tokens` / `length`, and no cap header."""
    with httpx.Client(base_url=capped.url, timeout=120) as c:
        r = c.post("/v1/messages", json={"model": "x", "max_tokens": 3, "messages": MSGS})
        assert "x-ft-output-cap" not in r.headers
        assert r.json()["stop_reason"] == "max_tokens"
        r = c.post("/v1/chat/completions", json={"model": "x", "messages": MSGS,
                                                 "max_tokens": 5})
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_default_cap_is_the_documented_one() -> None:
    assert default_output_cap("demo", None) == DEMO_OUTPUT_CAP
    assert default_output_cap(None, None) == DEMO_OUTPUT_CAP  # `ft serve` defaults to demo
    # random weights never end a reply: capped as in `ft agent-proxy --model demo-random`
    assert default_output_cap("demo-random", None) == DEMO_OUTPUT_CAP
    assert default_output_cap("/ckpt/qwen3", None) is None
    assert default_output_cap("demo", 1000) == 1000
    assert default_output_cap("demo", 0) is None
    doc = (Path(__file__).parents[2] / "docs" / "server.md").read_text()
    m = re.search(r"`--max-output-tokens N`[^|]*\| (\d+) for the demo model", doc)
    assert m and int(m.group(1)) == DEMO_OUTPUT_CAP, "docs/server.md states the default"
