"""The decode runner switches its attention plan while serving (issue #24 item 2, #20 item 6:
flashinfer's JIT off the request path; engine/attention_build.py, engine/plan_switch.py).

On a first start the runner decodes on the Triton paged kernel while flashinfer's module
builds on its own thread, and switches when the build is done, at a safe point between
steps. Here the switch is between two real plans of the tiny hybrid model (fp32): the Triton
kernel (run by the interpreter on CPU tensors) and the torch reference, both ways, through
the real engine: scheduler, chained (overlapped) decode steps, the builder thread. The CPU
has no CUDA graphs, so the runner's graph seams stand in for them (as in
tests/engine/test_graph_fault.py): `_capture` returns a handle naming the plan it was
captured on, `_replay` runs the step and checks that it replays a graph of the plan the step
was planned with. Bugs caught: a graph of the old plan replayed after the switch (its
kernels and buffers are gone), a switch with a step in flight (the chained step read the
old plan's buffers), a stream that never reaches a safe point (the overlap kept chaining), a
failed build or load that crashes the engine or leaves it without a plan, a token changed by
the switch (oracle: `generate`, the plain reference generator). Plus the idle warm-up
capturing every bucket again on the new plan, and the builder thread's niceness.
"""
from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("interprets the Triton plan on CPU tensors; the gpu-marked tests "
                "cover the GPU",
                allow_module_level=True)

import freetoken.kernels.triton.paged_attention as pa
from freetoken.engine.attention_build import PlanBuild
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams

N = 10  # tokens per request
SP = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_hf):
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.cfg.vocab_size, (7 + 5 * i,), generator=g).tolist()
               for i in range(2)]
    alone = [generate(model, p, SP, []).token_ids for p in prompts]
    return model, prompts, alone


@pytest.fixture(autouse=True)
def two_splits(monkeypatch):
    """The H200's ~64 KV splits cost seconds per interpreted step; the launches are the same."""
    monkeypatch.setattr(pa, "default_num_splits", lambda *a, **k: 2)


def _core(model, first: str):
    """An engine whose runner decodes on plan `first`, with stand-in graphs: returns the core
    and the log of (event, bucket, plan) of every capture and replay."""
    core = EngineCore(model, [], kv_tokens=512, state_slots=8, max_running=2, chunk_tokens=64,
                      decode_runner=True)
    runner = core.runner
    assert runner is not None
    runner.attention = first
    runner._graphs_allowed = lambda: runner.attention != "torch"  # CPU: stand-in graphs
    runner.use_graphs = runner._graphs_allowed()
    events: list[tuple[str, int, str]] = []

    def capture(bk, greedy):
        events.append(("capture", bk.size, runner.attention))
        return ("graph", bk.size, greedy, runner.attention)

    def replay(graph, bk, attn, greedy):
        assert graph[3] == attn.name, f"a {graph[3]} graph replayed for a {attn.name} step"
        events.append(("replay", bk.size, attn.name))
        runner._forward(bk.size, attn, greedy)  # what the graph computes

    runner._capture, runner._replay = capture, replay
    return core, events


def _serve(core, prompts, on_step=None) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        core.add(GenerateRequest(p, SP, request_id=str(i)),
                 lambda ev, i=i: out[i].extend(ev.token_ids))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        if on_step is not None:
            on_step(steps)
        assert steps < 200
    return out


@pytest.mark.parametrize("first,second", [("triton", "torch"), ("torch", "triton")])
def test_switch_mid_stream_keeps_every_token(setup, first, second, caplog) -> None:
    """Two streams decode on `first` while `second` "builds" (a real builder thread, held
    until the 4th engine step); the switch comes at a safe point, the streams go on to the
    end with the tokens they get alone, and every graph replayed after it is a graph of
    `second`, captured after the switch."""
    model, prompts, alone = setup
    core, events = _core(model, first)
    runner = core.runner
    gate, loads = threading.Event(), []
    runner._build = PlanBuild(second, build=lambda: gate.wait(30) and None,
                              load=lambda: loads.append(threading.get_ident()))

    def on_step(n: int) -> None:
        if n == 4:
            gate.set()
            assert runner._build.wait(10) == "ready"
            events.append(("built", 0, ""))

    with caplog.at_level(logging.INFO, logger="ft.engine"):
        got = _serve(core, prompts, on_step)
    assert got == alone
    assert runner.attention == second and runner.attention_switches == 1
    assert runner.building() is None and loads == [threading.get_ident()]  # loaded here
    switches = [r.getMessage() for r in caplog.records if "attention_switch" in r.getMessage()]
    assert len(switches) == 1 and f"old={first} new={second}" in switches[0], switches
    built = events.index(("built", 0, ""))
    after = events[built + 1:]
    before = events[:built]
    if first != "torch":  # graphs of `first` were replayed, then dropped
        assert ("replay", 2, first) in before
    if second == "torch":  # no graph reads a per-row slot list: eager from the switch
        assert not any(e[0] == "replay" for e in after)
        assert runner.graphs_held() == 0
    else:
        assert not any(e[0] == "replay" for e in before)
        assert after.count(("capture", 2, second)) == 1  # captured again, once, lazily
        assert ("replay", 2, second) in after
    assert all(e[2] == second for e in after if e[0] != "built")


@pytest.mark.parametrize("fail", ["build", "load"])
def test_failed_build_or_load_keeps_triton(setup, fail, caplog) -> None:
    """The build raises (nvcc missing, a compile error) or the built module does not load:
    the runner logs it once and decodes on Triton to the end; nothing crashes, no token
    changes."""
    model, prompts, alone = setup
    core, events = _core(model, "triton")
    runner = core.runner

    def build():
        if fail == "build":
            raise RuntimeError("Ninja build failed: nvcc not found")

    def load():
        raise OSError("undefined symbol in the module")

    runner._build = PlanBuild("torch", build=build, load=load)
    runner._build.wait(10)
    with caplog.at_level(logging.WARNING, logger="ft.engine"):
        got = _serve(core, prompts)
    assert got == alone
    assert runner.attention == "triton" and runner.attention_switches == 0
    assert runner.building() is None and not runner.switch_due()
    msgs = [r.getMessage() for r in caplog.records]
    key = "attention_build_failed" if fail == "build" else "attention_load_failed"
    assert sum(key in m for m in msgs) == 1, msgs
    assert "keeping=triton" in next(m for m in msgs if key in m)
    assert all(e[2] == "triton" for e in events)


def test_idle_warm_up_switches_and_captures_every_bucket_again(setup) -> None:
    """A build that ends while the server is idle: the next idle turn switches the plan (no
    request needed) and queues each bucket's captures again; they run on the new plan."""
    model, prompts, alone = setup
    core, events = _core(model, "torch")  # no graphs yet: the plan has no capture task
    runner = core.runner
    core.warmup.plan()
    assert not any(t.kind == "capture" for t in core.warmup.tasks)
    runner._build = PlanBuild("triton", build=lambda: None, load=lambda: None)
    runner._build.wait(10)
    assert core.warmup.pending == len(core.warmup.tasks) + 1  # the switch is idle work
    assert core.warmup.run_one()  # the switch
    assert runner.attention == "triton"
    caps = [t for t in core.warmup.tasks if t.kind == "capture"]
    assert {(t.size, t.greedy) for t in caps} == {(b, g) for b in runner.buckets
                                                 for g in (True, False)}
    while core.warmup.run_one():
        pass
    assert {e for e in events if e[0] == "capture"} == {("capture", b, "triton")
                                                        for b in runner.buckets}
    assert runner.graphs_held() == 2 * len(runner.buckets)
    assert _serve(core, prompts) == alone  # served from those graphs
    assert sum(e[0] == "capture" for e in events) == 2 * len(runner.buckets)


def test_builder_thread_runs_niced_off_the_engine_thread() -> None:
    """The build runs on its own thread at nice +BUILD_NICE (inherited by the ninja and nvcc
    processes it starts), so the engine thread's compiles keep the cores."""
    seen: dict[str, int] = {}

    def build():
        seen["thread"] = threading.get_ident()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    b = PlanBuild("flashinfer", build=build, load=lambda: None)
    assert b.wait(10) == "ready" and b.seconds >= 0
    assert seen["thread"] != threading.get_ident()
    assert seen["nice"] == min(19, base + b.nice)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # ours: as it was
