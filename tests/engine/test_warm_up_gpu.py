"""The idle warm-up on CUDA (issue #24 item 2, #20 item 6): its tasks, run one at a time as the
engine thread runs them between requests, capture every bucket's greedy and sampling graph
and run every prefill shape class, leave the step statistics clean, and the request after
them captures nothing and gets the eager model's tokens. Bug caught: a warm-up that left
graphs or prefill shapes to the first request (33.3 s TTFT on the H200)."""
from __future__ import annotations

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.types.api import GenerateRequest, SamplingParams
from freetoken.types.config import MoEConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["fused", "hybrid"])
def test_idle_warm_up_tasks_leave_nothing_for_the_first_request(tiny_hf, backend) -> None:
    d = tiny_hf("qwen3_5_moe")
    model, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=5), dtype=torch.float32,
                                  device="cuda", progress=False)
    core = EngineCore(model, [], kv_tokens=1024, state_slots=8, max_running=4, chunk_tokens=128,
                      moe=rt)
    runner = core.runner
    assert runner is not None and runner.use_graphs
    n = core.warmup.plan()
    kinds = [t.kind for t in core.warmup.tasks]
    assert kinds[0] == "decode" and kinds.count("capture") == 2 * len(runner.buckets)
    while core.warmup.run_one():
        assert not core.has_work()  # each task runs to its end: nothing left for the next step
    st = core.snapshot_stats()
    assert st["warmup"]["pending"] == 0 and st["warmup"]["done"] == n
    assert st["requests"] == 0 and st["prompt_tokens"] == 0
    assert {b: set(bk.graphs) for b, bk in runner.buckets.items()} == {
        b: {True, False} for b in runner.buckets}
    assert all(r["result"] in ("ok", "skipped") for r in core.warmup.done)
    spent = runner.capture_s
    ids = list(range(7, 40))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got: list[int] = []
    core.add(GenerateRequest(ids, sp, request_id="u"), lambda ev: got.extend(ev.token_ids))
    while core.has_work():
        core.step()
    assert runner.capture_s == spent  # no capture in the request's steps
    ref, _ = load_with_experts(d, MoEConfig(backend="fused"), dtype=torch.float32,
                               device="cuda", progress=False)
    assert got == generate(ref, ids, sp, []).token_ids
