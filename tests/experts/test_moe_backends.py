"""Every expert backend against `fused`: bit-identical fp32 logits on CPU (slot cache on the
CPU), across cache sizes that force misses, evictions, CPU work and fetches in one step."""
from __future__ import annotations

import pytest
import torch

from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.cli.build import load_with_experts
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig
from freetoken.types.forward_batch import ForwardBatch


def _logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.cfg
    c = Caches(KVPool(cfg, 128, torch.float32, "cpu"),
               StateTensors(cfg, 1, torch.float32, "cpu") if cfg.has_linear_attention else None)
    out = [model(ForwardBatch.single(ids[:40], 0, torch.arange(40), 0, all_logits=True), c)]
    for t in range(40, len(ids)):  # decode steps: batch-1 routing, the offload regime
        out.append(model(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), 0), c))
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
@pytest.mark.parametrize("backend,slots", [("offload", 3), ("offload", 12), ("cpu", 5),
                                           ("hybrid", 2), ("hybrid", 9), ("auto", 10)])
def test_backend_bit_identical_to_fused(tiny_hf, kind: str, backend: str, slots: int) -> None:
    d = tiny_hf(kind)
    fused = load_model(d, dtype=torch.float32, progress=False)
    ids = torch.randint(0, fused.cfg.vocab_size, (64,),
                        generator=torch.Generator().manual_seed(7)).tolist()
    want = _logits(fused, ids)
    m, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=slots),
                              dtype=torch.float32, progress=False)
    got = _logits(m, ids)
    assert torch.equal(got, want)
    st = rt.counters.as_dict()
    assert st["misses"] > 0
    if slots >= 9:  # with more than a step's worth of slots the global LRU keeps some experts warm
        assert st["hits"] > 0
    if backend in ("cpu", "hybrid"):
        assert st["cpu_experts"] > 0
    if backend in ("offload", "hybrid"):
        assert st["fetched"] > 0
    cache = rt.cache
    owner = cache.table.slot_owner
    assert int((owner >= 0).sum()) <= slots
    for s, g in enumerate(owner.tolist()):  # every resident slot holds its expert's weights
        if g >= 0:
            layer, e = divmod(g, rt.store.num_experts)
            assert torch.equal(cache.gate_up_slots[s], rt.store.gate_up(layer)[e])


def test_cpu_layers_and_greedy_generation(tiny_hf) -> None:
    d = tiny_hf("qwen3_5_moe")
    fused = load_model(d, dtype=torch.float32, progress=False)
    m, rt = load_with_experts(d, MoEConfig(backend="offload", cache_size=4, cpu_layers=2),
                              dtype=torch.float32, progress=False)
    ids = list(range(5, 25))
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    assert generate(m, ids, sp, [], moe=rt).token_ids == generate(fused, ids, sp, []).token_ids
    owner = rt.cache.table.slot_owner
    E = rt.store.num_experts
    n_moe = rt.store.num_layers
    assert [b.name for b in rt.backends][-2:] == ["cpu", "cpu"]
    assert all(g < 0 or g // E < n_moe - 2 for g in owner.tolist())  # CPU layers never cached


def test_gathered_decode_path_matches_grouped() -> None:
    """The CUDA decode path (gathered bmm, no host sync) against the grouped path, on CPU."""
    from freetoken.experts.ffn import dispatch_experts, gathered_experts

    g = torch.Generator().manual_seed(0)
    E, H, I, T, K = 6, 32, 16, 3, 4
    gu, dn = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[1, 2] = -1  # a CPU-flagged entry in slot terms
    mask = torch.rand(T, K, generator=g) > 0.3
    base = torch.full((T, K, H), 7.0)
    want = dispatch_experts(x, ids.clamp(min=0), gu, dn, base.clone(), mask=mask & (ids >= 0))
    got = gathered_experts(x, ids, gu, dn, base.clone(), mask=mask)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[~(mask & (ids >= 0))], base[~(mask & (ids >= 0))])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_branch_thread_count(tiny_hf, monkeypatch, dtype: torch.dtype) -> None:
    """--moe-cpu-threads reaches the CPU kernel of every layer; the default is torch's thread
    count, capped at the cores less one when a GPU is driven from the main thread."""
    import freetoken.kernels.cpu.expert_ops as ops
    from freetoken.experts import runtime_setup as setup

    seen: list[int | None] = []
    real = ops.cpu_experts

    def spy(*a, num_threads=None, **k):
        seen.append(num_threads)
        return real(*a, num_threads=num_threads, **k)

    monkeypatch.setattr(ops, "cpu_experts", spy)
    d = tiny_hf("qwen3_5_moe")
    m, _ = load_with_experts(d, MoEConfig(backend="cpu", cache_size=2, cpu_threads=3),
                             dtype=dtype, progress=False)
    _logits(m, list(range(5, 50)))
    # the CPU branch passes its count; hits computed on this CPU-resident cache use torch's
    branch = [t for t in seen if t is not None]
    assert branch and set(branch) == {3}

    monkeypatch.setattr(setup.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(setup.torch, "get_num_threads", lambda: 16)
    assert setup.default_cpu_threads("cpu") == 16
    assert setup.default_cpu_threads("cuda") == 15
    monkeypatch.setattr(setup.torch, "get_num_threads", lambda: 4)
    assert setup.default_cpu_threads("cuda") == 4
    monkeypatch.setattr(setup.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert setup.default_cpu_threads("cuda") == 1
    with pytest.raises(ValueError, match="moe-cpu-threads"):
        MoEConfig(backend="cpu", cpu_threads=0)


def test_profile_thread_mismatch_is_logged(tiny_hf, caplog) -> None:
    """B_H was measured with some thread count; a CPU branch run with another count gets a
    q* from the wrong B_H, and says so in one log line."""
    from freetoken.experts.cost_model import BandwidthProfile
    from freetoken.experts.runtime import MoERuntime

    d = tiny_hf("qwen3_5_moe")
    prof = BandwidthProfile(key={}, b_h=80.0, b_p=50.0, cpu_threads=8)
    caplog.set_level("INFO", logger="ft.experts")
    for threads, warned in ((3, True), (8, False)):
        caplog.clear()
        m = load_model(d, dtype=torch.float32, progress=False)
        MoERuntime.build(m, MoEConfig(backend="hybrid", cache_size=4, cpu_threads=threads),
                         "cpu", profile=prof)
        assert ("bw_profile_threads_differ" in caplog.text) == warned
