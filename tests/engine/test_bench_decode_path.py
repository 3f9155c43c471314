"""`ft bench decode --path engine`: batch 1 measured through EngineCore (what `ft serve` runs,
its decode overlap included) instead of `generate`. Bug caught: the flag not reaching the
measurement (the figure then silently comes from the other path)."""
from __future__ import annotations

import torch

from freetoken.bench import moe as bench_moe
from freetoken.experts.cost_model import BandwidthProfile
from freetoken.experts.store import ExpertStore
from freetoken.models.loader import load_model
from freetoken.types.config import MoEConfig


def test_engine_path_takes_batch_one_through_the_engine(tiny_hf, monkeypatch) -> None:
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    blocks = model.moe_blocks()
    store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                        [b.experts.down_proj.data for b in blocks], pin=False)
    calls: list[int] = []
    real = bench_moe.decode_batch

    def spy(model, prompts, n_tokens, cuda_graph, **kw):
        calls.append(len(prompts))
        return real(model, prompts, n_tokens, cuda_graph, **kw)

    monkeypatch.setattr(bench_moe, "decode_batch", spy)
    cpu = torch.device("cpu")
    prompt = list(range(3, 19))
    r = bench_moe.run_backend(model, store, "offload", MoEConfig(cache_size=4), cpu, prompt, 8,
                              cuda_graph=False, batch=1, engine=True)
    # the warm-up and the timed run, both through the engine
    assert calls == [1, 1] and r.tok_s > 0 and 0.0 <= r.hit_rate <= 1.0
    assert r.fetch_bytes_tok > 0
    r = bench_moe.run_backend(model, store, "offload", MoEConfig(cache_size=4), cpu, prompt, 8,
                              cuda_graph=False, batch=1)
    assert calls == [1, 1] and r.tok_s > 0  # the default batch-1 path is generate


PROFILE = BandwidthProfile(key={}, b_h=60.0, b_p=50.0, b_p_overlap=45.0, b_h_overlap=50.0,
                           expert_bytes=2**20)  # picks hybrid: auto has all three candidates


def _auto_bench(tiny_hf, monkeypatch, **kw):
    """`run_backend(..., "auto", ...)` on the tiny model with a profile that picks hybrid:
    (its result, the guard, [(max_tokens, settled) of every generate call, in order])."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    blocks = model.moe_blocks()
    store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                        [b.experts.down_proj.data for b in blocks], pin=False)
    monkeypatch.setattr("freetoken.experts.runtime.find_profile", lambda model, dtype: PROFILE)
    built, calls = [], []
    real_install, real_generate = bench_moe.install_backend, bench_moe.generate

    def install(*a):
        built.append(real_install(*a))
        return built[-1]

    def gen(model, prompt, sp, *a, **k):
        calls.append((sp.max_tokens, built[0].guard.settled))
        return real_generate(model, prompt, sp, *a, **k)

    monkeypatch.setattr(bench_moe, "install_backend", install)
    monkeypatch.setattr(bench_moe, "generate", gen)
    r = bench_moe.run_backend(model, store, "auto", MoEConfig(cache_size=4),
                              torch.device("cpu"), list(range(3, 19)), 40, cuda_graph=False,
                              **kw)
    return r, built[0].guard, calls


def test_auto_settles_in_the_warm_up_and_says_what_it_chose(tiny_hf, monkeypatch) -> None:
    """`ft bench decode --backends auto` times auto's steady state: its guard times every
    candidate in the untimed warm-up and has settled when the timed window starts, and the
    note says after how many steps and on what. Bug caught (H200, issue #20 item 4): the
    warm-up ran 8 tokens, so the timed window held the guard's whole timing (auto 83.6 tok/s
    against hybrid's 107.2 although it settled on hybrid)."""
    r, guard, calls = _auto_bench(tiny_hf, monkeypatch)
    assert guard.order == ["hybrid", "offload", "cpu"] and guard.settled
    assert calls[-1] == (40, True)  # the timed run started settled
    assert all(n != 40 for n, _ in calls[:-1])  # ... after warm-up runs only
    assert guard.settled_after >= 3 * (guard.discard + guard.window)
    assert (f"auto: settled on {guard.choice} after {guard.settled_after} warm-up decode "
            "steps (ms/step: hybrid ") in r.note
    assert ", offload " in r.note and ", cpu " in r.note and r.tok_s > 0


def test_auto_that_does_not_settle_in_the_warm_up_says_so(tiny_hf, monkeypatch) -> None:
    """Too short a warm-up (one round of 20 steps for a guard that needs 3 x 34): the row
    mixes the guard's phases, and its note must say so rather than pass for auto's rate."""
    monkeypatch.setattr(bench_moe, "AUTO_WARM_ROUNDS", 1)
    monkeypatch.setattr(bench_moe, "AUTO_WARM_MAX_STEPS", 20)
    r, guard, calls = _auto_bench(tiny_hf, monkeypatch)
    assert not guard.settled and calls[-1] == (40, False)
    assert "auto: NOT settled in the warm-up (19 decode steps), still timing " in r.note
    assert f"still timing {guard.phase}: the row mixes its candidates" in r.note


def test_auto_batch_warms_up_at_the_timed_width(tiny_hf, monkeypatch) -> None:
    """A batch of 2: the warm-up decodes 2 rows together through the engine, as the timed
    run does, so the guard compares its candidates at that width."""
    r, guard, calls = _auto_bench(tiny_hf, monkeypatch, batch=2)
    assert calls == [] and guard.settled and guard.widths == [2]
    assert f"auto: settled on {guard.choice} after " in r.note


def test_every_backend_warms_up_as_long_as_auto(tiny_hf, monkeypatch) -> None:
    """Every row's timed window starts after the same untimed decode: auto's guard needs
    3 x (2 + 32) steps to settle, and a fixed backend gets as many, at the timed width.
    Bug caught (H200, session 19, replayed router): fixed backends warmed up for 8 tokens,
    so their windows held the expert cache's fill toward the decode's hot set and auto's did
    not (the same hybrid: 176 tok/s as itself, 331 settled under auto)."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    blocks = model.moe_blocks()
    store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                        [b.experts.down_proj.data for b in blocks], pin=False)
    monkeypatch.setattr("freetoken.experts.runtime.find_profile", lambda model, dtype: PROFILE)
    runs: list[tuple[int, int]] = []  # (width, tokens) of every decode run, in order
    real_gen, real_batch = bench_moe.generate, bench_moe.decode_batch

    def gen(model, prompt, sp, *a, **k):
        runs.append((1, sp.max_tokens))
        return real_gen(model, prompt, sp, *a, **k)

    def batch(model, prompts, n_tokens, *a, **k):
        runs.append((len(prompts), n_tokens))
        return real_batch(model, prompts, n_tokens, *a, **k)

    monkeypatch.setattr(bench_moe, "generate", gen)
    monkeypatch.setattr(bench_moe, "decode_batch", batch)
    warm = {}
    for width in (1, 2):
        for backend in ("offload", "cpu", "auto"):
            runs.clear()
            bench_moe.run_backend(model, store, backend, MoEConfig(cache_size=4),
                                  torch.device("cpu"), list(range(3, 19)), 12,
                                  cuda_graph=False, batch=width)
            assert runs[-1] == (width, 12)  # the timed run
            warm[backend, width] = runs[:-1]
        assert warm["offload", width] == warm["cpu", width] == warm["auto", width] \
            == [(width, 3 * (2 + 32) + 8)]
