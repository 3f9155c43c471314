"""Engine paths the server tests cannot reach through a fake: a prompt longer than the KV pool,
a failing step, `build_engine` from `ft serve` flags, `--record-routing`, and /v1/stats."""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from freetoken.bench.routing_trace import load_trace
from freetoken.chat import ChatTokenizer
from freetoken.cli import main as ft_main
from freetoken.cli.build import build_engine
from freetoken.cli.options import engine_config_from_args
from freetoken.cli.serve import register as register_serve
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.server import create_app
from freetoken.types.api import AdmissionError, EngineClient, GenerateRequest, SamplingParams
from freetoken.types.config import EngineConfig
from tests.server.server_helpers import Server

KV_TOKENS = 300
IDS = list(range(1000, 1030))


@pytest.fixture(scope="module")
def small(tiny_chat_dir: Path):
    """A real engine whose KV pool (300 tokens) is far smaller than the model's context."""
    model = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(tiny_chat_dir)
    engine = AsyncEngine(EngineCore(model, tok.eos_token_ids, kv_tokens=KV_TOKENS,
                                    state_slots=16), tiny_chat_dir, "small")
    server = Server(create_app(engine, tok, api_key=None, served_model_names=["s"]))
    yield server, engine, model
    server.stop()
    engine.shutdown()


def test_prompt_longer_than_the_kv_pool_is_refused_at_once(small) -> None:
    """Upstream bug: a prompt longer than the KV pool was queued forever with no error. The real
    engine caps the context at the pool, so it is a 400 context_length_exceeded at once."""
    server, engine, _ = small
    assert engine.max_context == KV_TOKENS  # the model's own context is 262144
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "s", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 400}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded")
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "s", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 20}]})
    assert r.status_code == 200, r.text


async def _collect(engine: AsyncEngine, req: GenerateRequest) -> list[int]:
    out: list[int] = []
    async for ev in engine.generate(req):
        out += ev.token_ids
    return out


def _req(n: int = 8) -> GenerateRequest:
    return GenerateRequest(list(IDS), SamplingParams(max_tokens=n, temperature=0.0,
                                                     ignore_eos=True))


def test_failed_step_fails_the_requests_in_flight_and_frees_them(small, monkeypatch) -> None:
    """A step that raises must end the requests it held with an error (never a hang), free their
    KV and state slots, and leave the engine serving the next request correctly."""
    _, engine, model = small
    core = engine.core
    want = generate(model, IDS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                    []).token_ids
    real_forward, calls = type(model).forward, {"n": 0}

    def flaky(self, batch, caches):
        calls["n"] += 1
        if calls["n"] == 2:  # the prefill ran; the first decode step fails
            raise RuntimeError("injected device fault")
        return real_forward(self, batch, caches)

    monkeypatch.setattr(type(model), "forward", flaky)
    # (a lone request: isolation fails it with the forward pass's error, engine/isolation.py)
    with pytest.raises(RuntimeError, match="forward pass of this request failed.*injected device"):
        asyncio.run(asyncio.wait_for(_collect(engine, _req()), 60))
    monkeypatch.setattr(type(model), "forward", real_forward)
    sched, cache = core.sched, core.sched.cache
    assert not sched.running and not sched.waiting
    # nothing leaked: every KV slot is free or in the tree, unlocked; every state slot is free
    # or a snapshot
    assert cache.protected_size == 0
    assert sched.kv_alloc.num_free + cache.total_size == KV_TOKENS
    assert cache.state_pool.num_free + cache.num_snapshots == 16
    assert asyncio.run(asyncio.wait_for(_collect(engine, _req()), 60)) == want


def test_stats_count_what_the_responses_report(small) -> None:
    """/v1/stats of the real engine against the usage of the responses it served."""
    server = small[0]
    before = httpx.get(server.url + "/v1/stats").json()
    usage = []
    for _ in range(2):  # the second one reuses the first one's prefix
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "s", "max_tokens": 3, "messages": [{"role": "user", "content": "a b c d"}]})
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"])
    after = httpx.get(server.url + "/v1/stats").json()
    assert after["requests"] - before["requests"] == 2
    prompt = sum(u["prompt_tokens"] for u in usage)
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert cached > 0 and after["cached_tokens"] - before["cached_tokens"] == cached


def _serve_args(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    register_serve(p.add_subparsers(dest="command"))
    return engine_config_from_args(p.parse_args(["serve", *argv]))


def test_build_engine_from_serve_flags(tiny_chat_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """`ft serve` flags reach the engine: backend and cache size, context, KV pool (given, and
    sized by default to the whole context when RAM allows), pools, and routing recording."""
    args = _serve_args("--model", str(tiny_chat_dir), "--device", "cpu", "--dtype", "fp32",
                       "--moe-backend", "offload", "--moe-cache-rate", "0.5",
                       "--max-context", "2048", "--state-slots", "12", "--max-running", "3",
                       "--record-routing", str(tmp_path / "r.npz"))
    at_exit: list = []
    monkeypatch.setattr("atexit.register", at_exit.append)  # the recorder saves at exit
    engine = build_engine(args)
    try:
        core, model = engine.core, engine.core.model
        rt = core.moe
        pool = rt.store.num_layers * rt.store.num_experts
        assert rt.backend == "offload" and rt.cache.num_slots == round(0.5 * pool)
        assert core.max_context == 2048 and core.sched.kv_alloc.num_slots == 2048  # RAM allows
        assert core.caches.kv.num_slots == 2049  # plus the decode runner's scratch slot
        assert core.sched.cache.state_pool.num_slots == 12 and core.sched.max_running == 3
        assert engine.model_name == tiny_chat_dir.name
        # the real engine has every member the server reads (bug: no vocab_size, so token-id
        # prompts were bounded by the tokenizer's vocabulary, not the model's)
        members = set(EngineClient.__annotations__) | {
            n for n in vars(EngineClient) if not n.startswith("_")}
        assert {"vocab_size", "resize_experts", "max_output_tokens", "model_dir"} <= members
        assert all(hasattr(engine, n) for n in members), members - set(dir(engine))
        assert engine.vocab_size == model.cfg.vocab_size
        # the expert budget given (0.5) is the elastic watcher's ceiling (H200 bug: a server
        # at --moe-cache-rate 0.37 grew to every expert 3 s after ready)
        assert engine.elastic.max_expert_slots == rt.cache.num_slots < pool
        assert asyncio.run(asyncio.wait_for(_collect(engine, _req(5)), 60))
        saves = [f for f in at_exit if f.__qualname__.startswith("attach_recorder")]
        assert len(saves) == 1
        saves[0]()
        tr = load_trace(tmp_path / "r.npz")  # the served request's routing, saved at exit
        # 4 decode steps, plus the prompt's last token: the engine feeds it alone (a snapshot
        # point of this hybrid model), and the recorder counts any one-token batch as decode
        assert tr.decode.shape[1] == 5 and tr.decode.shape[2] == len(model.moe_blocks())
        assert tr.prefill is not None and tr.prefill.shape[2] == len(IDS) - 1
    finally:
        engine.shutdown()
    engine = build_engine(_serve_args("--model", str(tiny_chat_dir), "--device", "cpu",
                                      "--kv-tokens", "1500"))
    try:  # an explicit pool bounds the context; no flag: fused, nothing recorded
        assert engine.core.sched.kv_alloc.num_slots == 1500 and engine.max_context == 1500
        assert engine.core.moe is None or engine.core.moe.backend == "fused"
        assert engine.elastic.max_expert_slots is None  # no budget given: the pool
        assert all(b.route_hook is None for b in engine.core.model.moe_blocks())
    finally:
        engine.shutdown()


def test_generate_records_routing(tiny_chat_dir: Path, tmp_path: Path, capsys) -> None:
    """`ft generate --record-routing FILE`: one decode step per generated token after the first
    (which comes from the prefill), every MoE layer, top-k distinct in-range ids per step, and the
    prompt's routing as prefill; the backend flags of `ft serve` apply."""
    out = tmp_path / "route.npz"
    assert ft_main(["generate", "--model", str(tiny_chat_dir), "--prompt", "one two three four",
                    "--max-tokens", "6", "--json", "--record-routing", str(out),
                    "--moe-backend", "cpu", "--moe-cache-rate", "0.25"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["moe_backend"] == "cpu" and res["moe_stats"]["cpu_experts"] > 0
    cfg = json.loads((tiny_chat_dir / "config.json").read_text())
    E, K = cfg["num_experts"], cfg["num_experts_per_tok"]
    tr = load_trace(out)
    n_gen, n_prompt = len(res["token_ids"]), len(res["prompt_token_ids"])
    assert tr.decode.shape == (1, n_gen - 1, cfg["num_hidden_layers"], K)
    assert tr.prefill is not None and tr.prefill.shape == (1, cfg["num_hidden_layers"], n_prompt, K)
    ids = tr.decode[0].astype(np.int64)
    assert ids.min() >= 0 and ids.max() < E
    assert all(len(set(row)) == K for row in ids.reshape(-1, K).tolist())


def test_admission_error_shape_is_the_engine_contract(small) -> None:
    """The engine's own check (not the HTTP layer) refuses an over-long prompt by token count."""
    _, engine, _ = small
    with pytest.raises(AdmissionError) as e:
        engine.check(GenerateRequest(list(range(KV_TOKENS)), SamplingParams(max_tokens=1)))
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
