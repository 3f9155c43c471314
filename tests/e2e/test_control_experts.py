"""Re-budgeting the expert cache of a running server: results never change, bad sizes are
refused with a 400, and a failed allocation (a GPU out of memory) answers 409 with the previous
cache still serving — the upstream bug where a live rebuild OOMed and left the server stuck."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_helpers import Server

from freetoken.chat import ChatTokenizer
from freetoken.cli.build import load_with_experts
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.server import create_app
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig

IDS = list(range(1000, 1040))


@pytest.fixture(scope="module")
def offload(tiny_chat_dir):
    model, rt = load_with_experts(tiny_chat_dir, MoEConfig(backend="offload", cache_size=6),
                                  dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(tiny_chat_dir)
    engine = AsyncEngine(EngineCore(model, tok.eos_token_ids, kv_tokens=4096, max_context=4096,
                                    moe=rt),
                         tiny_chat_dir, "tiny-offload")
    server = Server(create_app(engine, tok, api_key=None, served_model_names=["t"]))
    fused = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    want = generate(fused, IDS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    []).token_ids
    yield server, rt, want
    server.stop()
    engine.shutdown()


def _tokens(url: str) -> list[int]:
    r = httpx.post(url + "/ft/v1/generate", timeout=60, json={
        "input_ids": IDS, "sampling": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            out += json.loads(line[6:])["token_ids"]
    return out


def _resize(url: str, **body: object) -> httpx.Response:
    return httpx.post(url + "/ft/v1/control/experts", json=body, timeout=60)


def test_resize_keeps_results(offload) -> None:
    server, rt, want = offload
    assert _tokens(server.url) == want
    for body, n in (
        ({"slots": 3}, 3),
        ({"rate": 0.5}, 16),
        ({"mem": 10**9}, 32),
        ({"slots": 6}, 6),
    ):
        r = _resize(server.url, **body)
        assert r.status_code == 200, r.text
        assert r.json()["slots"] == n and rt.cache.num_slots == n
        assert _tokens(server.url) == want
    assert httpx.get(server.url + "/v1/stats").json()["experts"]["slots"] == 6


@pytest.mark.parametrize("body", [{"slots": 0}, {"slots": 10**6}, {"rate": 1.5}, {"rate": 0},
                                  {"slots": "3"}, {"slots": 2.5}, {"slots": True}, {},
                                  {"slots": 3, "rate": 0.5}])
def test_bad_sizes_are_refused(offload, body: dict) -> None:
    server, rt, _ = offload
    before = rt.cache.num_slots
    r = _resize(server.url, **body)
    assert r.status_code == 400 and "message" in r.json()["error"]
    assert rt.cache.num_slots == before


def test_failed_allocation_keeps_serving(offload, monkeypatch) -> None:
    server, rt, want = offload
    cache = rt.cache
    before = (cache.num_slots, cache.table.slot_owner.clone(), cache.gate_up_slots.clone())

    def oom(n: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(cache, "_alloc_gate_up", oom)
    r = _resize(server.url, slots=20)
    assert r.status_code == 409 and r.json()["error"]["code"] == "allocation_failed"
    assert cache.num_slots == before[0]
    assert torch.equal(cache.table.slot_owner, before[1])
    assert torch.equal(cache.gate_up_slots, before[2])
    monkeypatch.undo()
    assert _tokens(server.url) == want  # still serving, same results


def test_fused_server_has_nothing_to_resize(live) -> None:
    server, _ = live
    r = _resize(server.url, slots=4)
    assert r.status_code == 400 and "fused" in r.json()["error"]["message"]
