"""On the GPU: `ft bench decode`'s offload row through `generate` with CUDA graphs counts the
timed steps alone, and timing a graph replay afterwards (`replay_ms`) leaves the counters as
they were. Bug caught (issue 20 item 3, H200): the 51 replays `replay_ms` runs after the run
route and fetch like decode steps, and the counters' window was read after them: 143 experts
a step "fetched" for 102 missed, (127 + 51) / 127 = 1.40x at 128 tokens."""
from __future__ import annotations

import pytest
import torch

from freetoken.bench import moe as bench_moe
from freetoken.bench.moe import TraceRouter, install_trace, uniform_trace
from freetoken.engine.generate import private_runner
from freetoken.experts.store import ExpertStore
from freetoken.models.loader import load_model
from freetoken.types.config import MoEConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("routing", ["random", "model"])
def test_offload_counts_through_graphs_cover_the_timed_steps(tiny_hf, monkeypatch,
                                                             routing: str) -> None:
    dev = torch.device("cuda")
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, device=dev, progress=False)
    blocks, cfg = model.moe_blocks(), model.cfg
    L, E, K = len(blocks), cfg.num_experts, cfg.top_k
    store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                        [b.experts.down_proj.data for b in blocks], pin=True)
    if routing == "random":
        install_trace(model, TraceRouter(uniform_trace(400, L, 1, E, K), E, K, dev))
    built = []
    real = bench_moe.install_backend
    monkeypatch.setattr(bench_moe, "install_backend", lambda *a: built.append(real(*a))
                        or built[-1])
    r = bench_moe.run_backend(model, store, "offload", MoEConfig(cache_size=L * E // 2), dev,
                              list(range(3, 35)), 24, cuda_graph=True)
    assert "graph replay alone" in r.note, r.note  # the replays ran, after the window
    # batch 1: a step routes K distinct experts in each MoE layer; offload fetches every miss
    assert r.routed_tok == L * K, (r.routed_tok, r.note)
    assert 0 < r.misses_tok == r.fetched_tok

    rt, runner = built[0], private_runner(model)
    before = rt.counters.as_dict()
    clock = int(rt.cache.table.clock.item())
    assert bench_moe.replay_ms(runner, 1, iters=4) is not None
    assert int(rt.cache.table.clock.item()) == clock + 5 * L  # 5 replays decided every layer
    assert rt.counters.as_dict() == before  # and their counts were dropped
