"""Issue #20 item 4: `auto` never loses to its own candidates because kernels were still warming
up while it timed its choice. Bug caught: the guard timed the choice first, from the first
decode step on, so the choice paid every JIT compile and graph capture (on the H200 it timed
hybrid at 9.14 ms/step against offload's 3.08 and fell back, while hybrid ran 155 tok/s to
auto's 123)."""
from __future__ import annotations

import time
import types

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.experts.auto import AutoGuard
from freetoken.experts.cost_model import BandwidthProfile
from freetoken.types.api import GenerateRequest, SamplingParams
from freetoken.types.config import MoEConfig

JIT_S, OFFLOAD_EXTRA_S = 0.25, 0.04


class _Clock:
    """The guard's clock, advanced by the test: step times exactly as injected (sleeps on a
    loaded 2-core machine overran the 5 ms margins)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    import freetoken.experts.auto as auto_mod

    c = _Clock()
    monkeypatch.setattr(auto_mod, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
    return c


def _drive(g: AutoGuard, cost, clock: _Clock) -> None:
    """Decode steps of width 1 until settled; `cost(i, phase)` is step i's seconds."""
    i = 0
    while not g.settled:
        g.on_step(decode=True, width=1)
        clock.sleep(cost(i, g.phase))
        g.end_step()
        i += 1


def _cost(i: int, phase: str) -> float:
    return JIT_S if i < 2 else (OFFLOAD_EXTRA_S if phase == "offload" else 0.0)


def test_guard_ignores_the_first_slow_steps_of_its_choice(clock: _Clock) -> None:
    """The same injected costs fool a guard that times from the first step (discard=0):
    the scenario is the bug's, and the fixed guard keeps the faster choice."""
    old = AutoGuard("hybrid", lambda m: 2, window=4, discard=0)
    _drive(old, _cost, clock)
    assert old.choice == "offload"  # the bug: warm-up charged to the choice
    new = AutoGuard("hybrid", lambda m: 2, window=4)
    _drive(new, _cost, clock)
    assert new.choice == "hybrid" and new.discarded >= 4


def test_guard_compares_phases_at_the_same_width(clock: _Clock) -> None:
    """The choice timed at batch 4, offload mostly at batch 1: overall means (25 ms against
    15 ms a step) would drop the choice although offload is slower at batch 4 (30 ms); only
    the width both phases ran is compared."""
    g = AutoGuard("hybrid", lambda m: 2, window=4, discard=0)
    for _ in range(4):  # choice: 4-row steps of 25 ms
        g.on_step(True, 4)
        clock.sleep(0.025)
        g.end_step()
    for w in (1, 1, 1, 4):  # offload: three 1-row steps of 10 ms, one 4-row step of 30 ms
        g.on_step(True, w)
        clock.sleep(0.01 if w == 1 else 0.03)
        g.end_step()
    assert g.times["offload"] < g.times["choice"]  # what the overall means say
    assert g.settled and g.choice == "hybrid"
    assert g.by_width["offload"][1][1] == 3 and g.by_width["choice"][4][1] == 4


def test_guard_leaves_a_capturing_step_untimed(clock: _Clock) -> None:
    g = AutoGuard("hybrid", lambda m: 2, window=2, discard=0)
    g.on_step(True, 1)
    g.discard_step()  # the runner captured a graph in this step
    clock.sleep(0.05)
    g.end_step()
    assert g.steps == 0 and g.discarded == 1


def test_auto_in_the_engine_keeps_the_faster_choice_despite_slow_first_steps(
        tiny_hf, monkeypatch) -> None:
    """A real engine under `auto` (its profile picks hybrid). The model's first two decode
    steps are slow (kernels compiling), and offload is truly slower per step; auto must settle
    on hybrid and the engine must keep decoding."""
    prof = BandwidthProfile(key={}, b_h=60.0, b_p=50.0, b_p_overlap=45.0, b_h_overlap=50.0,
                            expert_bytes=2**20)
    monkeypatch.setattr("freetoken.experts.runtime.find_profile", lambda model, dtype: prof)
    model, rt = load_with_experts(tiny_hf("qwen3_5_moe"), MoEConfig(backend="auto", cache_size=5),
                                  dtype=torch.float32, progress=False)
    guard = rt.guard
    assert guard is not None and guard.choice == "hybrid"
    guard.window = 4
    real, decodes = model.forward, [0]
    extra = 0.15  # offload's injected cost per step: above the CPU's own hybrid/offload gap

    def forward(batch, caches):
        if all(n == 1 for n in batch.new_lens):  # a decode step
            decodes[0] += 1
            time.sleep(0.6 if decodes[0] <= 2 else extra if guard.phase == "offload" else 0.0)
        return real(batch, caches)

    monkeypatch.setattr(model, "forward", forward)
    core = EngineCore(model, [], kv_tokens=512, state_slots=8, max_running=2, moe=rt)
    out: list[int] = []
    core.add(GenerateRequest(list(range(5, 25)), SamplingParams(max_tokens=16, temperature=0.0,
                                                               ignore_eos=True)),
             lambda ev: out.extend(ev.token_ids))
    while core.has_work():
        core.step()
    assert len(out) == 16 and decodes[0] >= 12
    assert guard.settled and guard.choice == "hybrid", guard.times
