"""Where a decode step's time goes (`/v1/stats` `decode_phases`, issue 20 item 2: the served
path against the benchmark): summed since the start, `step_s` inside `EngineCore.step` for
decode-only steps, `wait_s` of it blocked on the runner's tokens, `between_s` from one decode
step's end to the next one's start. Oracle: delays injected at each place (the runner's collect,
the caller's loop) and the number of decode-only steps a request of N tokens takes."""
from __future__ import annotations

import time

import torch

from freetoken.engine.core import EngineCore
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams
from tests.engine.test_engine_core import _prompt

WAIT, GAP = 0.004, 0.003


def _core(model) -> EngineCore:
    return EngineCore(model, [], kv_tokens=768, state_slots=12, max_running=4, chunk_tokens=32,
                      decode_runner=True)


def _decode(core: EngineCore, prompt: list[int], n: int, gap: float) -> None:
    core.add(GenerateRequest(prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                    ignore_eos=True), request_id="r"),
             lambda ev: None)
    while core.has_work():
        core.step()
        time.sleep(gap)


def test_decode_phases_split_step_wait_and_gap(tiny_hf) -> None:
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    prompt = _prompt(model.cfg.vocab_size, 20, 3)
    plain = _core(model)
    _decode(plain, prompt, 16, 0.0)
    ph = plain.snapshot_stats()["decode_phases"]
    # 16 tokens: the first from the prompt's step, then 15 decode-only steps (each step()
    # completes the one in flight and launches the next)
    assert ph["steps"] == 15, ph
    assert ph["wait_s"] <= ph["step_s"]

    slow = _core(model)
    collect = slow.runner.collect

    def slow_collect(pending):
        time.sleep(WAIT)
        return collect(pending)

    slow.runner.collect = slow_collect
    _decode(slow, prompt, 16, GAP)
    ph = slow.snapshot_stats()["decode_phases"]
    n = ph["steps"]
    assert n == 15, ph
    assert ph["wait_s"] >= n * WAIT and ph["step_s"] >= ph["wait_s"], ph
    assert ph["between_s"] >= (n - 1) * GAP, ph  # the first counts from a non-decode step: 0
    assert plain.snapshot_stats()["decode_phases"]["wait_s"] < ph["wait_s"]
