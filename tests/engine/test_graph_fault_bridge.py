"""A decode step that raises while the CPU bridge is mid-step (issue 22): hybrid on the tiny
model, its CPU share through the bridge's worker (experts/bridge.py), decoded by the runner
with stand-in graphs (tests/engine/test_graph_fault.py explains the seam). The step that
raises has begun the bridge's step, so the worker waits for layers that never come; the old
failure was that the next step's layers then deadlocked against it until a timeout
(`cpu_bridge_failed ... never arrived`), the bridge was dropped and the re-run rows failed.

Each test proves: no hang (a watchdog bounds the run), the worker released and its step
counter re-aligned (`CpuBridge.abandon`), the step re-run (eagerly), every request's tokens
equal to a clean hybrid run's (itself equal to `generate` alone on fused: fp32 backends are
bit-identical), and the steps after the fault still going through the same, healthy bridge.

Shapes: none beyond the engine's."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.experts import bridge as bridge_mod
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig
from tests.engine.test_graph_fault import N, _prompts, _run, _with_graphs

WATCHDOG_S = 120.0  # the whole run; a hang fails here instead of wedging the suite


def _hybrid(tiny_hf):
    d = tiny_hf("qwen3_5_moe")
    model, rt = load_with_experts(d, MoEConfig(backend="hybrid", cache_size=5),
                                  dtype=torch.float32, progress=False)
    fused = load_model(d, dtype=torch.float32, progress=False)
    prompts = _prompts(model.cfg.vocab_size)
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    alone = [generate(fused, p, greedy, []).token_ids for p in prompts]
    return model, rt, prompts, greedy, alone


def _core(model, rt) -> EngineCore:
    core = EngineCore(model, [], kv_tokens=2048, state_slots=16, max_running=4,
                      decode_runner=True, moe=rt)
    assert core.runner is not None and core.runner.bridge is not None
    return core


def _bounded_run(core, prompts, sp):
    box: dict = {}

    def go() -> None:
        try:
            box["out"] = _run(core, prompts, sp)
        except BaseException as e:  # noqa: BLE001 — re-raised in the test's thread
            box["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(WATCHDOG_S)
    assert not t.is_alive(), "the engine hung after the fault"
    if "error" in box:
        raise box["error"]
    return box["out"]


def _send_raising_at(br, layer: int):
    """Make `br.send` raise right after handing `layer` to the worker (the worker computes
    that layer; no later layer of the step is ever sent). Returns the undo."""
    send = br.send

    def raising(m, *a):
        send(m, *a)
        if m == layer:
            raise RuntimeError(f"injected: the step failed after layer {m}'s send")

    br.send = raising
    return lambda: br.__dict__.pop("send", None)


def _check(core, rt, br, caplog, got, errors, alone, seq_at_fault: list[int]) -> None:
    runner = core.runner
    assert errors == [None] * len(alone), errors
    assert got == alone  # every row as alone
    assert runner.bridge is br and not br.failed and int(br.err[0]) == 0
    assert br.abandoned == 1
    assert int(br.seq_dev) == br.seq  # the device's step counter re-aligned with the host's
    assert br.last_run == br.seq  # the worker went through every step begun
    # the steps after the fault still ran on the bridge
    assert len(seq_at_fault) == 1 and br.seq > seq_at_fault[0] + 2
    assert rt.counters.as_dict()["cpu_experts"] > 0
    # (fp32 banks: the native loop takes the one-row steps, the re-runs alone among them)
    assert br.native is None or br.native_steps > 0
    text = caplog.text
    assert "cpu_bridge_failed" not in text and "cpu_bridge_slow" not in text, text
    assert "cpu_bridge_abandoned" in text
    assert not core.sched.running and not core.sched.waiting and not core.sched.alone


@pytest.fixture
def short_timeout(monkeypatch):
    # without the fix the deadlock ends at this timeout (then cpu_bridge_failed): keep it
    # short so a regression fails in seconds; the fix never waits for it
    monkeypatch.setattr(bridge_mod, "WORKER_TIMEOUT_S", 3.0)


@pytest.mark.parametrize("where", ["before_any_layer", "after_layer_1"])
def test_replay_raising_mid_bridge_step_fails_no_request(tiny_hf, caplog, short_timeout,
                                                         where: str) -> None:
    """The second replay raises with the bridge's step begun: before the graph sent any layer
    (a failed launch), or after layer 1's send (the worker computing it, layers 2.. never
    sent). Every row is re-run alone, eagerly, on the same bridge."""
    model, rt, prompts, greedy, alone = _hybrid(tiny_hf)
    core = _core(model, rt)
    br = core.runner.bridge
    assert br.L >= 3
    seq_at_fault: list[int] = []

    calls = _with_graphs(core)  # stand-in graphs; the second replay is replaced below
    stand_in = core.runner._replay

    def replay(graph, bk, attn, greedy_) -> None:
        if len(calls) + 1 != 2:
            return stand_in(graph, bk, attn, greedy_)
        seq_at_fault.append(br.seq)
        calls.append((2, bk.size, core.runner.graph_faults))
        if where == "before_any_layer":
            raise RuntimeError("injected: cudaGraphLaunch failed")
        undo = _send_raising_at(br, 1)
        try:
            core.runner._forward(bk.size, attn, greedy_)
        finally:
            undo()

    core.runner._replay = replay
    with caplog.at_level(logging.INFO, logger="ft"):
        got, errors = _bounded_run(core, prompts, greedy)
    assert core.runner.graph_faults == 1 and not core.runner.use_graphs
    assert calls[1][1] == 4  # the fault hit a full replay of the four rows
    _check(core, rt, br, caplog, got, errors, alone, seq_at_fault)
    again, errors = _bounded_run(core, prompts[-2:], greedy)  # and it keeps serving
    assert errors == [None, None] and again == alone[-2:]
    assert not br.failed and br.last_run == br.seq


def test_eager_runner_step_raising_mid_bridge_step_fails_no_request(tiny_hf, caplog,
                                                                    short_timeout) -> None:
    """No graphs: an eager step through the runner (which also hands the CPU share to the
    bridge) raises after layer 1's send. The worker of an eager step waits without a clock
    (it may compile), so this one wedged until the next step's timeout. The engine isolates
    the step's rows (engine/isolation.py); each re-runs alone and, the fault gone, finishes
    with its own tokens."""
    model, rt, prompts, greedy, alone = _hybrid(tiny_hf)
    core = _core(model, rt)
    runner, br = core.runner, core.runner.bridge
    assert not runner.use_graphs  # the CPU: the runner's steps are eager
    seq_at_fault: list[int] = []
    forward = runner._forward

    def faulty(Bk, attn, greedy_) -> None:
        if Bk == 4 and not seq_at_fault:
            seq_at_fault.append(br.seq)
            undo = _send_raising_at(br, 1)
            try:
                return forward(Bk, attn, greedy_)
            finally:
                undo()
        return forward(Bk, attn, greedy_)

    runner._forward = faulty
    with caplog.at_level(logging.INFO, logger="ft"):
        got, errors = _bounded_run(core, prompts, greedy)
    assert "step_failed_isolating" in caplog.text
    _check(core, rt, br, caplog, got, errors, alone, seq_at_fault)
