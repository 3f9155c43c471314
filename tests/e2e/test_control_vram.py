"""/ft/v1/control/vram (`ft ctl vram`): the expert cache, the KV pool and the state pool
rebuilt together on a running server. Oracle: the fused model's greedy tokens, before and
after every rebuild; a failed allocation answers 409 with the previous sizes serving."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from server_helpers import Server

from freetoken.chat import ChatTokenizer
from freetoken.cli.build import load_with_experts
from freetoken.engine import elastic
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.engine.vram_watch import attach_elastic
from freetoken.models.loader import load_model
from freetoken.server import create_app
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig
from tests.e2e.test_control_experts import IDS, _tokens


@pytest.fixture(scope="module")
def served(tiny_chat_dir):
    model, rt = load_with_experts(tiny_chat_dir, MoEConfig(backend="offload", cache_size=6),
                                  dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(tiny_chat_dir)
    engine = AsyncEngine(EngineCore(model, tok.eos_token_ids, kv_tokens=4096, max_context=2048,
                                    moe=rt), tiny_chat_dir, "tiny-offload")
    attach_elastic(engine, interval_s=0)
    server = Server(create_app(engine, tok, api_key=None, served_model_names=["t"]))
    fused = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    want = generate(fused, IDS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    []).token_ids
    yield server, engine, want
    server.stop()
    engine.shutdown()


def _vram(url: str, **body: object) -> httpx.Response:
    return httpx.post(url + "/ft/v1/control/vram", json=body, timeout=60)


def test_rebuilds_keep_results(served) -> None:
    server, _, want = served
    assert _tokens(server.url) == want
    for body in ({"expert_slots": 3, "kv_tokens": 2048}, {"kv_tokens": 6000},
                 {"expert_slots": 12}, {"state_slots": 3}, {"state_slots": 80, "kv_tokens": 5000},
                 {"expert_slots": 6, "kv_tokens": 4096, "state_slots": 64}):
        r = _vram(server.url, **body)
        assert r.status_code == 200, r.text
        for k, v in body.items():
            assert r.json()[k] == v
        assert _tokens(server.url) == want
    st = httpx.get(server.url + "/v1/stats").json()["vram"]
    assert (st["expert_slots"], st["kv_tokens"], st["state_slots"], st["rebuilds"]) == (
        6, 4096, 64, 6)


@pytest.mark.parametrize("body", [{}, {"kv_tokens": 100}, {"expert_slots": 0},
                                  {"expert_slots": 10**6}, {"kv_tokens": "9000"},
                                  {"expert_slots": True}, {"kv_tokens": 2.5},
                                  {"state_slots": 0}, {"state_slots": "8"}])
def test_bad_sizes_are_refused(served, body: dict) -> None:
    server, _, _ = served
    r = _vram(server.url, **body)
    assert r.status_code == 400 and "message" in r.json()["error"], r.text


def test_failed_allocation_answers_409_and_serves_on(served, monkeypatch) -> None:
    server, engine, want = served
    before = engine.elastic.stats()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(elastic, "new_kv_pool", oom)
    r = _vram(server.url, expert_slots=3, kv_tokens=8000)
    assert r.status_code == 409 and r.json()["error"]["code"] == "allocation_failed"
    now = engine.elastic.stats()
    assert (now["expert_slots"], now["kv_tokens"]) == (before["expert_slots"],
                                                       before["kv_tokens"])
    monkeypatch.undo()
    assert _tokens(server.url) == want


def test_request_past_the_rebuild_wait_gets_503_with_retry_after(served, monkeypatch) -> None:
    """A generate request arriving while a rebuild holds the engine past the wait: 503 in the
    API's error shape with Retry-After, and the next request after the rebuild is served."""
    server, engine, want = served
    real, gate = elastic.new_kv_pool, threading.Event()

    def slow(*a, **k):
        gate.wait(20)
        return real(*a, **k)

    monkeypatch.setattr(elastic, "new_kv_pool", slow)
    monkeypatch.setattr(engine, "rebuild_wait_s", 0.3)
    done: list = []
    th = threading.Thread(target=lambda: done.append(_vram(server.url, kv_tokens=5000)))
    th.start()
    try:
        t0 = time.monotonic()
        while not engine.elastic.rebuilding.is_set():
            assert time.monotonic() - t0 < 20
            time.sleep(0.01)
        r = httpx.post(server.url + "/ft/v1/generate", timeout=60, json={
            "input_ids": IDS, "sampling": {"max_tokens": 4, "temperature": 0}})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "engine_rebuilding"
    finally:
        gate.set()
        th.join(timeout=60)
    assert done and done[0].status_code == 200
    assert _tokens(server.url) == want
