"""CUDA-graph decode (issue: GPU decode fast path): replayed steps give the eager engine's greedy
tokens for 256 tokens in fp32 on every backend, batched and alone, and the fused and offload
backends really replay graphs."""
from __future__ import annotations

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate, private_runner
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams
from freetoken.types.config import MoEConfig
from tests.engine.drive import greedy_tokens

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["fused", "offload", "hybrid", "cpu", "auto"])
def test_graph_replay_equals_eager(tiny_hf, backend: str) -> None:
    d = tiny_hf("qwen3_5_moe")
    # (auto: no bandwidth measurement for the tiny shape; its guard still switches rules)
    moe = None if backend == "fused" else MoEConfig(backend=backend, cache_size=6,
                                                     measure_bw=False)
    model, rt = load_with_experts(d, moe, dtype=torch.float32, device="cuda", progress=False)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (30 + 7 * i,), generator=g).tolist() for i in range(3)]
    eager, _ = greedy_tokens(model, prompts[:1], 256, decode_runner=False, moe=rt)
    graphs, core = greedy_tokens(model, prompts[:1], 256, decode_runner=True, cuda_graph=True,
                                  moe=rt)
    assert graphs == eager
    assert core.runner.replays >= 250  # hybrid too: its CPU share goes through the bridge
    # three requests decoding together (bucket 4: one padding row)
    eager3, _ = greedy_tokens(model, prompts, 64, decode_runner=False, moe=rt)
    graphs3, core3 = greedy_tokens(model, prompts, 64, decode_runner=True, cuda_graph=True,
                                    moe=rt)
    assert graphs3 == eager3
    assert core3.runner.replays > 0
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    assert generate(model, prompts[0], sp, [], moe=rt).token_ids == eager[0][:64]


def test_chained_generate_stops_where_eager_stops(tiny_hf) -> None:
    """generate() launches step n+1 before reading step n's token (chained on the device). On a
    stop token it must end exactly where the eager path ends, drop the step run ahead, and the
    next call must not see it (same tokens again)."""
    d = tiny_hf("qwen3_5_moe")
    model = load_model(d, dtype=torch.float32, device="cuda", progress=False)
    prompt = list(range(7, 50))
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    full = generate(model, prompt, sp, [], cuda_graph=False).token_ids
    assert generate(model, prompt, sp, []).token_ids == full
    stop = full[20]
    first = full.index(stop)
    sp_eos = SamplingParams(max_tokens=48, temperature=0.0)
    for _ in range(2):
        res = generate(model, prompt, sp_eos, [stop])
        assert res.token_ids == full[:first + 1] and res.finish_reason == "stop"
    runner = private_runner(model)
    assert not runner._open and runner.replays > 40


def test_seeded_sampling_same_in_graph_and_eager(tiny_hf) -> None:
    d = tiny_hf("qwen3_5_moe")
    model = load_model(d, dtype=torch.float32, device="cuda", progress=False)
    prompt = list(range(5, 40))
    sp = SamplingParams(max_tokens=64, temperature=0.8, top_k=50, top_p=0.9, seed=1234,
                        ignore_eos=True)
    a = generate(model, prompt, sp, [], cuda_graph=True).token_ids
    b = generate(model, prompt, sp, [], cuda_graph=False).token_ids
    c = generate(model, prompt, sp, [], cuda_graph=True).token_ids
    assert a == b == c
    sp2 = SamplingParams(max_tokens=64, temperature=0.8, top_k=50, top_p=0.9, seed=99,
                         ignore_eos=True)
    assert generate(model, prompt, sp2, []).token_ids != a


def test_warm_up_captures_every_bucket_before_the_first_request(tiny_hf) -> None:
    """`ft serve` warms up on CUDA: every bucket's greedy and sampling graph exists before the
    first request, and the first request then captures nothing."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, device="cuda",
                       progress=False)
    core = EngineCore(model, [], kv_tokens=512, state_slots=8, max_running=4)
    core.warm_up()
    assert core.runner is not None and core.runner.use_graphs
    held = {b: set(bk.graphs) for b, bk in core.runner.buckets.items()}
    assert held == {b: {True, False} for b in core.runner.buckets}
    graphs = {b: dict(bk.graphs) for b, bk in core.runner.buckets.items()}
    core.add(GenerateRequest(list(range(3, 30)), SamplingParams(max_tokens=8, temperature=0.0,
                                                               ignore_eos=True)),
             lambda ev: None)
    while core.has_work():
        core.step()
    assert all(core.runner.buckets[b].graphs == graphs[b] for b in graphs)


def test_graphs_are_captured_again_after_a_slot_cache_resize(tiny_hf) -> None:
    """Bug this catches: after a re-budget (`ft bench elastic`'s 6 GB shrink and regrow) every
    recapture into the old graph pool tripped the CUDA caching allocator's `use_count > 0`
    assert, so decode ran eagerly from then on (H200, 2026-12-03). Decode, shrink, decode,
    regrow, decode: each phase replays newly captured graphs and gives the eager tokens."""
    d = tiny_hf("qwen3_5_moe")
    moe = MoEConfig(backend="offload", cache_size=6, measure_bw=False)
    model, rt = load_with_experts(d, moe, dtype=torch.float32, device="cuda", progress=False)
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(11)
    phases = [[torch.randint(0, V, (20 + 5 * i,), generator=g).tolist() for i in range(2)]
              for _ in range(3)]  # new prompts each phase: no prefix reuse across them
    wants = [greedy_tokens(model, ps, 48, decode_runner=False, moe=rt)[0] for ps in phases]
    core = EngineCore(model, [], kv_tokens=4096, state_slots=16, max_running=4,
                      chunk_tokens=64, decode_runner=True, cuda_graph=True, moe=rt)
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for phase, (slots, prompts, want) in enumerate(zip((None, 3, 6), phases, wants)):
        if slots is not None:
            rt.resize(slots=slots)
        out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            core.add(GenerateRequest(p, sp, [], request_id=f"p{phase}r{i}"),
                     lambda ev, i=i, out=out: out[i].extend(ev.token_ids))
        before = core.runner.replays
        while core.has_work():
            core.step()
        assert [out[i] for i in range(len(prompts))] == want, phase
        assert core.runner.replays - before >= 40, (phase, core.runner.replays - before)
        assert not any(b.failures for b in core.runner.buckets.values()), phase
