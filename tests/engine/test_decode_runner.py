"""The decode runner (static device buffers, the path CUDA graphs capture) against the eager
engine: the same tokens for every request, on the CPU where no graph is captured but every
layer takes its device-slot branch (index_copy_ K/V writes, state read and written in place by
slot, padded buckets with masked routing)."""
from __future__ import annotations

import pytest
import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.graph_capture import buckets_for
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(core: EngineCore, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add(r, lambda e, rid=r.request_id: out[rid].extend(e.token_ids))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 5000
    return out


def test_buckets() -> None:
    assert buckets_for(1) == [1]
    assert buckets_for(3) == [1, 2, 3]
    assert buckets_for(16) == [1, 2, 4, 8, 16]
    assert buckets_for(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_runner_equals_eager(tiny_hf, kind: str) -> None:
    model = load_model(tiny_hf(kind), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    base = _prompt(V, 40, 0)
    prompts = [base + _prompt(V, 5 + 9 * i, i + 1) for i in range(5)]
    # 13 eos ids spread over the vocabulary: rows block them until min_tokens (or always)
    stop = list(range(3, V, 40))
    reqs = [GenerateRequest(p, SamplingParams(max_tokens=10 + 3 * i, temperature=0.0,
                                              ignore_eos=i % 2 == 0, min_tokens=6,
                                              stop_token_ids=[7]), request_id=f"r{i}")
            for i, p in enumerate(prompts)]
    # 3 of max_running 4 decode together in a padded bucket of 4 at some steps
    eager = _run(EngineCore(model, stop, kv_tokens=512, state_slots=12, max_running=4,
                            chunk_tokens=32, decode_runner=False), reqs)
    core = EngineCore(model, stop, kv_tokens=512, state_slots=12, max_running=4,
                      chunk_tokens=32, decode_runner=True)
    fast = _run(core, reqs)
    assert fast == eager
    if kind == "qwen3_5_moe":  # (this seed stops a row early; min_tokens held it back first)
        assert any(len(t) < 10 + 3 * i for i, t in enumerate(eager.values()))
    assert core.runner is not None and core.runner.steps > 10  # the runner did the decoding


@pytest.mark.parametrize("backend", ["hybrid", "cpu", "offload"])
def test_runner_slot_backends_equal_eager(tiny_hf, backend: str) -> None:
    """The slot-cache backends through the runner: q* and the miss count on the device, the CPU
    share handed to the bridge's worker thread (hybrid, cpu), fills, merge — the eager engine's
    tokens exactly (fp32: every backend is bit-identical to fused)."""
    from freetoken.cli.build import load_with_experts
    from freetoken.types.config import MoEConfig

    model, rt = load_with_experts(tiny_hf("qwen3_5_moe"),
                                  MoEConfig(backend=backend, cache_size=5),
                                  dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    prompts = [_prompt(V, 20 + 6 * i, 40 + i) for i in range(3)]
    reqs = [GenerateRequest(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                            request_id=f"s{i}") for i, p in enumerate(prompts)]
    eager = _run(EngineCore(model, [2], kv_tokens=512, state_slots=8, max_running=4,
                            chunk_tokens=32, decode_runner=False, moe=rt), reqs)
    core = EngineCore(model, [2], kv_tokens=512, state_slots=8, max_running=4,
                      chunk_tokens=32, decode_runner=True, moe=rt)
    assert _run(core, reqs) == eager
    runner = core.runner
    assert runner is not None and runner.steps > 5
    # 5 slots < 8 experts: steps of 3 rows can route more distinct experts than the slots
    # hold, and the decision sends the overflow to the CPU even under offload
    if backend != "offload":
        assert runner.bridge is not None and runner.bridge.seq == runner.steps
        assert rt.counters.as_dict()["cpu_experts"] > 0


def test_runner_runs_auto_through_the_bridge(tiny_hf, monkeypatch) -> None:
    """`auto` decodes through the runner (the path CUDA graphs capture) like hybrid: its layers
    get the bridge, the guard times its choice (hybrid, from a profile that favours it), then
    offload, then cpu over runner steps, each change of phase rewrites the device fetch tables in
    place (a graph holds their address), and once settled the engine launches steps ahead
    again. Tokens equal fused's. Bugs caught: `auto` left eager (not capturable), a table left
    on the previous phase's rule, the overlap never resumed."""
    from freetoken.cli.build import load_with_experts
    from freetoken.engine.generate import generate
    from freetoken.experts.cost_model import BandwidthProfile
    from freetoken.types.config import MoEConfig

    d = tiny_hf("qwen3_5_moe")
    fused = load_model(d, dtype=torch.float32, progress=False)
    V, E = fused.cfg.vocab_size, fused.cfg.num_experts
    prompts = [_prompt(V, 20 + 6 * i, 60 + i) for i in range(2)]
    sp = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
    want = {f"a{i}": generate(fused, p, sp, []).token_ids for i, p in enumerate(prompts)}
    prof = BandwidthProfile(key={}, b_h=60.0, b_p=50.0, b_p_overlap=45.0, b_h_overlap=50.0,
                            expert_bytes=2**20)
    monkeypatch.setattr("freetoken.experts.runtime.find_profile", lambda model, dtype: prof)
    model, rt = load_with_experts(d, MoEConfig(backend="auto", cache_size=5),
                                  dtype=torch.float32, progress=False)
    guard = rt.guard
    assert guard is not None and guard.choice == "hybrid"
    guard.window = 3
    core = EngineCore(model, [2], kv_tokens=512, state_slots=8, max_running=4,
                      chunk_tokens=32, decode_runner=True, moe=rt)
    runner = core.runner
    assert runner is not None and runner.capturable and runner.bridge is not None
    for b in model.moe_blocks():  # the tables a first step makes (their listeners first)
        b.experts._device_num_fetch()
    layer = model.moe_blocks()[0].experts
    hybrid_rule = layer.rule.table(E)
    assert layer._fetch_table.tolist() == hybrid_rule != [-1] * (E + 1)
    seen: list[tuple[str, list[int]]] = []  # after the layers' own listeners
    guard.listeners.append(lambda: seen.append((guard.phase, layer._fetch_table.tolist())))
    reqs = [GenerateRequest(p, sp, request_id=f"a{i}") for i, p in enumerate(prompts)]
    assert _run(core, reqs) == want
    assert [ph for ph, _ in seen] == ["offload", "cpu", "settled"]
    assert seen[0][1] == [-1] * (E + 1)  # timing offload: fetch every miss
    assert seen[1][1] == [0] * (E + 1)  # timing cpu: fetch none
    assert seen[2][1] == [guard.num_fetch(m) for m in range(E + 1)]  # the kept rule
    assert seen[2][1] == layer.rule.table(E) and guard.choice in guard.order
    assert core.steps_ahead > 0 and runner.bridge.seq == runner.steps > 6


def test_runner_steps_count_in_the_decode_phases(tiny_hf) -> None:
    """/v1/stats' `decode_phases` split every decode-only step, on the runner's path too (the
    H200's served runs reported 0 steps after 256-token streams)."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    core = EngineCore(model, [], kv_tokens=256, state_slots=6, max_running=2, chunk_tokens=32,
                      decode_runner=True)
    reqs = [GenerateRequest(_prompt(V, 12, i), SamplingParams(max_tokens=9, temperature=0.0,
                                                              ignore_eos=True),
                            request_id=f"p{i}") for i in range(2)]
    _run(core, reqs)
    ph = core.stats.summary()["decode_phases"]
    assert ph["steps"] >= 7, ph  # 8 decode steps a request after its prefill, 2 rows a step
    assert ph["step_s"] > 0 and 0 <= ph["wait_s"] <= ph["step_s"]
