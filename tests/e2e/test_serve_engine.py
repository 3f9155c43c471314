"""The real engine behind the real server: SDK round trips, prefix reuse across turns,
interleaved concurrent streams, and abort on disconnect returning the pools to baseline — with
the eager engine and with decode steps overlapped through the decode runner (the CUDA path)."""
from __future__ import annotations

import asyncio
import threading
import time

import anthropic
import httpx
import openai
import pytest


@pytest.fixture(params=["live", "live_overlap"])
def served(request):
    return request.getfixturevalue(request.param)


def _wait_idle(engine, timeout: float = 20.0) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        s = engine.stats()["cache"]
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError("engine did not go idle")


def test_sdks_and_second_turn_reuses_prefix(served) -> None:
    server, _engine = served
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    msgs = [{"role": "system", "content": "You are terse. " * 40},
            {"role": "user", "content": "Say something about caches."}]
    r1 = oa.chat.completions.create(model="any-name", messages=msgs, max_tokens=12,
                                    temperature=0)
    assert r1.choices[0].finish_reason in ("length", "stop")
    assert r1.usage.completion_tokens >= 1
    text = r1.choices[0].message.content or ""
    msgs2 = msgs + [{"role": "assistant", "content": text},
                    {"role": "user", "content": "And about GPUs?"}]
    r2 = oa.chat.completions.create(model="any-name", messages=msgs2, max_tokens=4)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens - 1, (cached, r1.usage.prompt_tokens)
    assert r2.usage.prompt_tokens > cached  # only the new part was prefilled

    an = anthropic.Anthropic(base_url=server.url, api_key="x")
    with an.messages.stream(model="claude-opus-4-8", max_tokens=8,
                            system="You are terse. " * 40,
                            messages=[{"role": "user", "content": "hello"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens >= 1
    assert final.usage.cache_read_input_tokens > 0  # shares the system prompt with turn 1


def test_parallel_streams_interleave(served) -> None:
    server, engine = served
    _wait_idle(engine)
    n = 4

    async def one(i: int, client: httpx.AsyncClient) -> list[float]:
        body = {"model": "m", "stream": True, "max_tokens": 24, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"stream {i} " * (5 + i)}]}
        times = []
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    times.append(time.perf_counter())
        return times

    async def main() -> list[list[float]]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(one(i, c) for i in range(n)))

    streams = asyncio.run(main())
    assert all(len(t) >= 10 for t in streams)
    # interleaved: every stream's first token arrives before any stream's last token
    assert max(t[0] for t in streams) < min(t[-1] for t in streams)


def test_disconnect_aborts_and_frees(served) -> None:
    server, engine = served
    base = _wait_idle(engine)
    body = {"model": "m", "stream": True, "max_tokens": 4000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "long " * 50}]}
    got = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/chat/completions",
                                                       json=body) as r:
            for line in r.iter_lines():
                if '"content"' in line:
                    got.set()
                    return  # closes the connection mid-stream

    t = threading.Thread(target=client)
    t.start()
    assert got.wait(30)
    t.join(10)
    s = _wait_idle(engine)
    assert s["kv_protected"] == 0  # no lock left
    assert s["state_free"] + s["snapshots"] == s["state_slots"]  # no working state leaked
    assert s["kv_used"] == s["kv_cached"]  # every used slot belongs to the tree
    assert s["kv_cached"] >= base["kv_cached"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "still there?"}]})
    assert r.status_code == 200


def test_over_long_prompt_is_rejected_at_once(live) -> None:
    server, _ = live
    t0 = time.time()
    r = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": "m", "max_tokens": 10,
        "messages": [{"role": "user", "content": "word " * 270000}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert time.time() - t0 < 10


def test_overlapped_serving_answers_like_eager(live, live_overlap) -> None:
    """The same greedy chat requests through both servers, one after the other (the batch a
    request lands in must not differ between the two): the same text and finish reasons, and
    the overlapped engine really launched steps ahead."""
    def answers(server) -> list[tuple[str, str]]:
        out = []
        for i in range(3):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                "model": "m", "max_tokens": 20, "temperature": 0,
                "messages": [{"role": "user", "content": f"count to {i} " * (3 + 2 * i)}]})
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            out.append((c["message"]["content"], c["finish_reason"]))
        return out

    before = live_overlap[1].core.steps_ahead
    assert answers(live_overlap[0]) == answers(live[0])
    assert live_overlap[1].core.steps_ahead > before
