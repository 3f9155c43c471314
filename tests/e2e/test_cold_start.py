"""Issue #20 item 1: no crash on a cold start. A real engine with the CPU bridge (hybrid through
the decode runner, as `ft serve` runs it on CUDA) behind the real app.

- A first step that takes longer than any timeout (the first launch compiles kernels: Triton
  JIT and graph capture took 39-105 s on the H200) must not fail the bridge's worker; the
  server comes up and serves the `fused` tokens. Bug caught: the worker's wall-clock timeout
  on layer 0 (`layer 0 of step 1 never arrived`), then `BridgeError` out of `warm_up`.
- A worker that does fail (at warm-up, or while serving) is an error the engine recovers from:
  it drops the bridge, logs it, and keeps serving with the same tokens (the CPU share then runs
  on the eager branch). Bug caught: a dead server.
- `auto` with every expert fitting runs plain offload, which needs no bridge.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from server_helpers import Server

from freetoken.chat import ChatTokenizer
from freetoken.cli.build import load_with_experts
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.experts import bridge as bridge_mod
from freetoken.experts.bridge import CpuBridge
from freetoken.experts.runtime import MoERuntime
from freetoken.experts.slot_cache import SlotCache
from freetoken.models.loader import load_model
from freetoken.server import create_app
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig

IDS = list(range(2000, 2030))
N = 10


@pytest.fixture(scope="module")
def want(tiny_chat_dir) -> list[int]:
    fused = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    return generate(fused, IDS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
                    []).token_ids


def _tokens(url: str) -> tuple[int, list[int], str]:
    r = httpx.post(url + "/ft/v1/generate", timeout=120, json={
        "input_ids": IDS, "sampling": {"max_tokens": N, "temperature": 0, "ignore_eos": True}})
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            out += json.loads(line[6:]).get("token_ids", [])
    return r.status_code, out, r.text


def _serve(tiny_chat_dir):
    """A hybrid engine whose decode steps go through the runner and its CPU bridge, warmed up
    as `ft serve` warms up, behind the real app. Returns (server, engine, core, runtime)."""
    model, rt = load_with_experts(tiny_chat_dir, MoEConfig(backend="hybrid", cache_size=6),
                                  dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(tiny_chat_dir)
    core = EngineCore(model, tok.eos_token_ids, kv_tokens=4096, max_context=4096,
                      max_running=2, decode_runner=True, moe=rt)
    assert core.runner is not None and core.runner.bridge is not None
    core.warm_up()  # (build_engine does this on CUDA)
    engine = AsyncEngine(core, tiny_chat_dir, "tiny-hybrid")
    server = Server(create_app(engine, tok, api_key=None, served_model_names=["t"]))
    return server, engine, core, rt


def test_slow_first_launch_does_not_fail_the_bridge(tiny_chat_dir, want, monkeypatch) -> None:
    monkeypatch.setattr(bridge_mod, "WORKER_TIMEOUT_S", 0.2)
    real_send, slow = CpuBridge.send, [True]

    def send(self, m, *a):
        if m == 0 and slow[0]:  # the first launch "compiles" before layer 0's flag
            slow[0] = False
            time.sleep(1.0)  # five times the worker's timeout
        return real_send(self, m, *a)

    monkeypatch.setattr(CpuBridge, "send", send)
    server, engine, core, rt = _serve(tiny_chat_dir)
    try:
        assert not slow[0]  # the slow launch happened (in warm-up)
        br = core.runner.bridge
        assert br is not None and not br.failed and br.steps_done > 0  # still on the bridge
        status, toks, text = _tokens(server.url)
        assert status == 200 and toks == want, text
        assert rt.counters.as_dict()["cpu_experts"] > 0
    finally:
        server.stop()
        engine.shutdown()


def test_failed_worker_at_warm_up_falls_back_and_serves(tiny_chat_dir, want, monkeypatch,
                                                         caplog) -> None:
    def boom(self, *a):
        raise RuntimeError("injected worker failure")

    monkeypatch.setattr(CpuBridge, "_python_step", boom)
    monkeypatch.setattr(CpuBridge, "_native_step", boom)
    with caplog.at_level("ERROR", logger="ft"):
        server, engine, core, rt = _serve(tiny_chat_dir)
    try:
        assert core.runner.bridge is None  # dropped; the runner serves on without it
        assert "cpu_bridge_failed" in caplog.text and "injected worker failure" in caplog.text
        status, toks, text = _tokens(server.url)
        assert status == 200 and toks == want, text
        assert rt.counters.as_dict()["cpu_experts"] > 0  # the CPU share, eagerly now
    finally:
        server.stop()
        engine.shutdown()


def test_worker_failing_while_serving_fails_one_request_only(tiny_chat_dir, want,
                                                             monkeypatch) -> None:
    server, engine, core, _ = _serve(tiny_chat_dir)
    try:
        real, fail = CpuBridge._run, [True]

        def run(self, *a):
            if fail[0]:
                fail[0] = False
                self._failed = RuntimeError("injected worker failure")
                return False
            return real(self, *a)

        monkeypatch.setattr(CpuBridge, "_run", run)
        status, toks, _ = _tokens(server.url)  # the step that fails loses this request
        assert toks != want and not fail[0]
        assert core.runner.bridge is None
        status, toks, text = _tokens(server.url)  # the server still serves, same tokens
        assert status == 200 and toks == want, text
    finally:
        server.stop()
        engine.shutdown()


def test_auto_with_every_expert_fitting_attaches_no_bridge(tiny_chat_dir, monkeypatch) -> None:
    """On the H200 a first start with every expert fitting ran `auto` as offload under its
    guard, which took the CPU bridge (device fills are off while the guard may switch rules)
    and crashed in warm-up. Every expert fitting leaves nothing to split: plain offload, no
    guard, and (fills on the device, as on CUDA) no bridge."""
    model = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    pool = len(model.moe_blocks()) * model.cfg.num_experts
    monkeypatch.setattr(SlotCache, "can_fill_on_device", lambda self, store: True)
    rt = MoERuntime.build(model, MoEConfig(backend="auto", cache_size=pool), "cpu")
    assert rt.backend == "offload" and rt.guard is None
    assert rt.bridge_for(4) is None and rt.capturable(None)
    small = MoERuntime.build(load_model(tiny_chat_dir, dtype=torch.float32, progress=False),
                             MoEConfig(backend="auto", cache_size=pool // 2), "cpu")
    assert small.backend == "auto" and small.guard is not None  # (a real split: guarded)
