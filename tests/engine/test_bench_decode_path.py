"""`ft bench decode --path engine`: batch 1 measured through EngineCore (what `ft serve` runs,
its decode overlap included) instead of `generate`. Bug caught: the flag not reaching the
measurement (the figure then silently comes from the other path)."""
from __future__ import annotations

import torch

from freetoken.bench import moe as bench_moe
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
    assert calls == [1] and r.tok_s > 0 and 0.0 <= r.hit_rate <= 1.0 and r.fetch_bytes_tok > 0
    r = bench_moe.run_backend(model, store, "offload", MoEConfig(cache_size=4), cpu, prompt, 8,
                              cuda_graph=False, batch=1)
    assert calls == [1] and r.tok_s > 0  # the default batch-1 path is generate


def test_auto_reports_what_its_guard_ran(tiny_hf, monkeypatch) -> None:
    """`ft bench decode --backends auto` says which backend `auto` ran and what its guard
    timed, so its figure can be read (a choice kept, or the fallback to offload)."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    blocks = model.moe_blocks()
    store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                        [b.experts.down_proj.data for b in blocks], pin=False)
    built = []
    real = bench_moe.install_backend
    monkeypatch.setattr(bench_moe, "install_backend", lambda *a: built.append(real(*a))
                        or built[-1])
    r = bench_moe.run_backend(model, store, "auto", MoEConfig(cache_size=4),
                              torch.device("cpu"), list(range(3, 19)), 80, cuda_graph=False)
    guard = built[0].guard
    assert guard.settled and r.tok_s > 0
    assert f"auto: settled, running {guard.choice} (timed choice " in r.note
    assert "offload" in r.note.split("timed", 1)[1]
