"""A harness that gives up on a slow prefill and sends the same request again (issue 28, item 5),
over HTTP against the real engine. Claude Code abandons a request after 300 s without its first
event and re-sends it; here that timeout is the client's `give_up_s`, scaled down to a fraction
of a second, and the engine's steps are slowed (`slow_steps`) so the prompt takes a few seconds
to prefill in chunks.

Regression: the abort threw the computed prefix away, so the re-sent prompt prefilled twice.
Oracle: the engine's own counters — `prefill_tokens_computed` (every prompt token it computed) and
the re-send's `cache_read_input_tokens` — must add up to one prefill of the prompt; the reply
must equal the one an uninterrupted run of the prompt gives (greedy)."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import Server

from freetoken.chat import ChatTokenizer
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.models.loader import load_model
from freetoken.server import anthropic_routes, create_app

STEP_S = 0.08  # added to every engine step: a slow local prefill, a few seconds in all
GIVE_UP_S = 0.6  # the harness's 300 s, scaled


def body(topic: str) -> dict:
    """A ~640-token prompt (10 chunks), its own per test so no test reuses another's prefix."""
    words = " ".join(f"{topic}{i}.py changed line {i % 97} in module m{i % 13};"
                     for i in range(45))
    return {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True,
            "system": "You are a coding agent.",
            "messages": [{"role": "user", "content": "Review this diff:\n" + words}]}


@pytest.fixture(scope="module")
def slow_stack(tiny_chat_dir: Path) -> Iterator[tuple[Server, EngineCore]]:
    """Its own engine (its own prefix cache and counters), 64-token chunks, slowed steps."""
    model = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(tiny_chat_dir)
    core = EngineCore(model, tok.eos_token_ids, kv_tokens=8192, state_slots=16, max_running=4,
                      chunk_tokens=64, max_context=8192)
    step = core.step

    def slow_step() -> None:
        time.sleep(STEP_S)
        step()

    core.step = slow_step  # type: ignore[method-assign]
    engine = AsyncEngine(core, tiny_chat_dir, "tiny")
    server = Server(create_app(engine, tok, api_key=None, served_model_names=["tiny"],
                               parser_family="qwen3_5_moe"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(anthropic_routes, "KEEPALIVE_S", 0.1)
        yield server, core
    server.stop()
    engine.shutdown()


def _events(lines: Iterator[str], give_up_s: float | None) -> Iterator[tuple[str, dict]]:
    """(event, data) as they arrive; stops when `give_up_s` passed without `message_start`."""
    t0, name, started = time.monotonic(), "", False
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            started = started or name == "message_start"
            yield name, json.loads(line[6:])
        if give_up_s is not None and not started and time.monotonic() - t0 > give_up_s:
            return


def _stream(url: str, b: dict, give_up_s: float | None = None) -> list[tuple[str, dict]]:
    with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/messages", json=b) as r:
        assert r.status_code == 200
        return list(_events(r.iter_lines(), give_up_s))  # leaving the block hangs up


def _usage(evs: list[tuple[str, dict]]) -> dict:
    return next(d["message"]["usage"] for n, d in evs if n == "message_start")


def _text(evs: list[tuple[str, dict]]) -> str:
    return "".join(d["delta"].get("text", "") for n, d in evs if n == "content_block_delta")


def _prefilled(core: EngineCore) -> int:
    return core.stats.summary()["prefill_tokens_computed"]


def _wait(cond, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    assert cond()


def test_resent_request_resumes_the_abandoned_prefill(slow_stack) -> None:
    server, core = slow_stack
    b, base = body("resend"), _prefilled(core)
    first = _stream(server.url, b, GIVE_UP_S)
    assert [n for n, _ in first] and {n for n, _ in first} == {"ping"}  # alive, no token yet
    _wait(lambda: core.sched.stats()["running"] == 0)  # the hang-up aborted it
    done = _prefilled(core) - base
    again = _stream(server.url, b)
    u = _usage(again)
    n = u["input_tokens"] + u["cache_read_input_tokens"]
    assert 0 < done < n, (done, n)  # given up mid-prefill
    assert u["cache_read_input_tokens"] == done  # resumed where the abandoned one stopped
    assert _prefilled(core) - base == n  # every prompt token computed once over both requests
    assert again[-1][0] == "message_stop"
    # the resumed reply is the uninterrupted one (greedy): a fresh run of the same prompt on
    # its own (a different system prompt, so nothing of it is cached) ends the same way
    fresh = _stream(server.url, {**b, "system": "You are a coding agent!"})
    assert _usage(fresh)["cache_read_input_tokens"] < 16
    assert _text(fresh) == _text(again)


def test_resend_while_the_first_still_prefills_attaches_to_it(slow_stack) -> None:
    """The re-send can arrive before the abandoned request's connection is gone (a proxy in
    between still holds it): it waits for the running prefill of the shared prompt instead of
    computing it a second time beside it, and resumes from it once that one ends."""
    server, core = slow_stack
    b, base = body("attach"), _prefilled(core)
    first: list = []
    t = threading.Thread(target=lambda: first.extend(_stream(server.url, b)))
    t.start()
    _wait(lambda: _prefilled(core) > base)
    again = _stream(server.url, b)
    t.join(30)
    n = _usage(first)["input_tokens"] + _usage(first)["cache_read_input_tokens"]
    c0 = _usage(first)["cache_read_input_tokens"]  # the system head the other tests left
    assert c0 < 16
    # the whole prompt but its last token, which is fed again for the re-send's own logits
    assert _usage(again)["cache_read_input_tokens"] == n - 1
    assert _prefilled(core) - base == n - c0 + 1
    assert _text(again) == _text(first)
