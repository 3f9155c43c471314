"""Batches the other engine tests do not build: decode steps of more than 8 sequences (past the
CPU decode kernels' row limits and the 8-row width of the small-batch paths), and the `auto`
guard under batched decoding."""
from __future__ import annotations

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.experts.cost_model import BandwidthProfile
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams
from freetoken.types.config import MoEConfig

N_SEQ = 11


def _prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (9 + 2 * i,), generator=g).tolist() for i in range(n)]


def _run_all(core: EngineCore, prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """Greedy outputs of every prompt, run together, and the widest decode step seen."""
    out: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        core.add(GenerateRequest(p, SamplingParams(max_tokens=n, temperature=0.0,
                                                   ignore_eos=True), request_id=str(i)),
                 lambda ev, i=i: out[i].extend(ev.token_ids))
    widest, real_batch = 0, core.eager.batch

    def spy(items, moe):
        nonlocal widest
        widest = max(widest, sum(1 for it in items if it.n == 1))
        return real_batch(items, moe)

    core.eager.batch = spy  # type: ignore[method-assign]
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 1000
    return out, widest


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_decode_batch_of_more_than_8_sequences(tiny_hf, kind: str) -> None:
    """11 sequences decoding in one step give each its own plain-path tokens (a row mix-up in
    the batched recurrent state, the packed K/V gather or the sampler would swap outputs)."""
    model = load_model(tiny_hf(kind), dtype=torch.float32, progress=False)
    prompts = _prompts(model.cfg.vocab_size, N_SEQ)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [generate(model, p, sp, []).token_ids for p in prompts]
    core = EngineCore(model, [], kv_tokens=2048, state_slots=32, max_running=N_SEQ,
                      chunk_tokens=1024)
    got, widest = _run_all(core, prompts, 6)
    assert widest == N_SEQ
    assert got == want


# a measured profile under which the cost model picks hybrid: auto then has all three candidates
PROFILE = BandwidthProfile(key={}, b_h=60.0, b_p=50.0, b_p_overlap=45.0, b_h_overlap=50.0,
                           expert_bytes=2**20)


@pytest.fixture(scope="module")
def auto_run(tiny_hf):
    """Three sequences decoding together under `auto` (every candidate: a profile that picks
    hybrid; guard window 4), and `fused`'s tokens. 21 decode steps: each candidate takes 2
    untimed and 4 timed ones, 18 in all."""
    d = tiny_hf("qwen3_5_moe")
    fused = load_model(d, dtype=torch.float32, progress=False)
    prompts = _prompts(fused.cfg.vocab_size, 3)
    sp = SamplingParams(max_tokens=22, temperature=0.0, ignore_eos=True)
    want = [generate(fused, p, sp, []).token_ids for p in prompts]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("freetoken.experts.runtime.find_profile", lambda model, dtype: PROFILE)
        model, rt = load_with_experts(d, MoEConfig(backend="auto", cache_size=6),
                                      dtype=torch.float32, progress=False)
    guard = rt.guard
    assert guard is not None and guard.order == ["hybrid", "offload", "cpu"]
    assert guard.phase == guard.choice == "hybrid"
    guard.window = 4
    core = EngineCore(model, [], kv_tokens=1024, state_slots=16, max_running=3,
                      chunk_tokens=1024, moe=rt)
    got, widest = _run_all(core, prompts, 22)
    return guard, got, want, widest, rt


def test_auto_with_several_decodes_keeps_fused_tokens(auto_run) -> None:
    """`auto` timing offload, hybrid and cpu in turn (each phase a different split of the
    same experts) and then running the one it kept gives fused's greedy tokens."""
    guard, got, want, widest, _ = auto_run
    assert widest == 3 and got == want
    assert guard.settled and guard.choice in guard.order


def test_auto_guard_times_batched_decode_steps(auto_run) -> None:
    """21 decode steps of 3 sequences each with a window of 4: the guard must have timed
    every candidate at width 3 and settled. Catches the guard counting only one-token steps as
    decode (it took the step kind from the layer's token count, T == 1), which left `auto`
    untimed whenever several sequences decoded together."""
    guard, rt = auto_run[0], auto_run[4]
    assert guard.phase == "settled" and set(guard.times) == {"hybrid", "offload", "cpu"}
    assert guard.widths == [3] and guard.settled_after == 18
    st = rt.stats()
    assert st["auto"]["phase"] == "settled" and st["auto"]["running"] == guard.choice
    assert st["cpu_experts"] > 0 and st["fetched"] > 0  # the CPU and the link both worked


def test_auto_guard_times_plain_generate(tiny_hf, monkeypatch) -> None:
    """`generate` (`ft generate`) marks its steps too: one prefill, then 13 one-token decode
    steps settle a guard of window 4 (no profile: offload and cpu, 12 steps). Catches a step
    runner that never marks its steps."""
    monkeypatch.setattr("freetoken.experts.runtime.find_profile", lambda model, dtype: None)
    d = tiny_hf("qwen3_5_moe")
    model, rt = load_with_experts(d, MoEConfig(backend="auto", cache_size=6),
                                  dtype=torch.float32, progress=False)
    guard = rt.guard
    guard.window = 4
    prompt = _prompts(model.cfg.vocab_size, 1)[0]
    generate(model, prompt, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True), [],
             moe=rt)
    assert guard.order == ["offload", "cpu"]
    assert guard.phase == "settled" and set(guard.times) == {"offload", "cpu"}
