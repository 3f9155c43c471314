"""Issue #20 item 4: `auto` never loses to its own candidates because kernels were still warming
up while it timed its choice. Bug caught: the guard timed the choice first, from the first
decode step on, so the choice paid every JIT compile and graph capture (on the H200 it timed
hybrid at 9.14 ms/step against offload's 3.08 and fell back, while hybrid ran 155 tok/s to
auto's 123)."""
from __future__ import annotations

import time

import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.experts.auto import AutoGuard
from freetoken.experts.cost_model import BandwidthProfile
from freetoken.types.api import GenerateRequest, SamplingParams
from freetoken.types.config import MoEConfig
from tests.experts.auto_clock import Clock, drive

JIT_S = 0.25  # a step that compiles kernels
EXTRA_S = {"hybrid": 0.0, "offload": 0.04, "cpu": 0.02}  # each candidate's steady step cost


def _guard(discard: int = 2) -> AutoGuard:
    return AutoGuard({"hybrid": lambda m: 2, "offload": lambda m: -1, "cpu": lambda m: 0},
                     window=4, discard=discard)


def _cost(i: int, running: str) -> float:
    return JIT_S if i < 2 else EXTRA_S[running]


def test_guard_ignores_the_first_slow_steps_of_its_choice(clock: Clock) -> None:
    """The same injected costs fool a guard that times from the first step (discard=0): the
    scenario is the bug's, and the fixed guard keeps the faster choice."""
    old = _guard(discard=0)
    drive(old, clock, _cost)
    assert old.choice == "cpu"  # the bug: warm-up charged to the choice
    new = _guard()
    drive(new, clock, _cost)
    assert new.choice == "hybrid" and new.discarded == 6


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
    extra = 0.15  # offload's and cpu's injected cost per step: above the CPU's own gaps

    def forward(batch, caches):
        if all(n == 1 for n in batch.new_lens):  # a decode step
            decodes[0] += 1
            time.sleep(0.6 if decodes[0] <= 2 else 0.0 if guard.running == "hybrid" else extra)
        return real(batch, caches)

    monkeypatch.setattr(model, "forward", forward)
    core = EngineCore(model, [], kv_tokens=512, state_slots=8, max_running=2, moe=rt)
    out: list[int] = []
    core.add(GenerateRequest(list(range(5, 25)), SamplingParams(max_tokens=24, temperature=0.0,
                                                               ignore_eos=True)),
             lambda ev: out.extend(ev.token_ids))
    while core.has_work():
        core.step()
    assert guard.order == ["hybrid", "offload", "cpu"]
    assert len(out) == 24 and decodes[0] >= 18
    assert guard.settled and guard.choice == "hybrid", guard.compared
