"""On the GPU: streamed prefill (two buffers on a copy stream, device-driven fills, seeding)
gives the fused greedy tokens for 256 tokens, with one buffer and with every expert over the
link too, for offload and hybrid; the seeded table stays consistent with the slot weights."""
from __future__ import annotations

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig
from tests.experts.invariants import check_tables

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend,extra", [
    ("offload", {}),
    ("offload", {"prefill_overlap": False}),
    ("offload", {"prefill_hit_d2d": False}),
    ("hybrid", {}),
])
def test_streamed_prefill_greedy_equals_fused_on_gpu(tiny_hf, backend: str, extra: dict) -> None:
    d = tiny_hf("qwen3_5_moe")
    prompt = list(range(3, 300))
    sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    fused = load_model(d, dtype=torch.float32, device="cuda", progress=False)
    want = generate(fused, prompt, sp, [], prefill_chunk=128).token_ids
    m, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=2 * 8 + 5,
                                           prefill_stream="on", prefill_stream_tokens=64,
                                           **extra),
                              dtype=torch.float32, device="cuda", progress=False)
    got = generate(m, prompt, sp, [], prefill_chunk=128, moe=rt).token_ids
    assert got == want
    assert rt.streamer.chunks == 2 and rt.counters.streamed > 0  # 128 + 128 stream, 41 does not
    check_tables(rt.cache.table)
    t = rt.cache.table
    E = rt.store.num_experts
    for s, g in enumerate(t.slot_owner.tolist()):
        if g >= 0:
            layer, e = divmod(g, E)
            assert torch.equal(rt.cache.gate_up_slots[s].cpu(), rt.store.gate_up(layer)[e])
            assert torch.equal(rt.cache.down_slots[s].cpu(), rt.store.down(layer)[e])


@pytest.mark.parametrize("prefix", [0, 37])
def test_chunk_attention_on_cuda_matches_the_masked_reference(prefix: int) -> None:
    """A later prefill chunk on CUDA attends through a lower-right causal bias (no [n, L] mask),
    a first one through the flash kernel; both equal the CPU's explicit-mask path."""
    from freetoken.layers.step_context import attend

    g = torch.Generator().manual_seed(0)
    n, hq, hk, d = 50, 16, 2, 256
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(prefix + n, hk, d, generator=g)
    v = torch.randn(prefix + n, hk, d, generator=g)
    want = attend(q.double(), k.double(), v.double(), prefix, d ** -0.5)
    got = attend(q.cuda(), k.cuda(), v.cuda(), prefix, d ** -0.5).cpu()
    assert (got.double() - want).abs().max() < 2e-3


def test_chunked_gated_delta_on_cuda_matches_the_cpu_loop() -> None:
    """Prefill's gated-delta chunk scan on CUDA (Qwen3.6 head dims) equals the CPU's."""
    from freetoken.layers.gated_delta import chunk_gated_delta

    g = torch.Generator().manual_seed(0)
    n, h, dk, dv = 300, 4, 128, 128
    q = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=g), dim=-1)
    v = torch.randn(n, h, dv, generator=g)
    gate = -torch.rand(n, h, generator=g) * 0.5
    beta = torch.rand(n, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g) * 0.1
    want_o, want_s = chunk_gated_delta(q, k, v, gate, beta, s0)
    o, s = chunk_gated_delta(*(t.cuda() for t in (q, k, v, gate, beta, s0)))
    assert (o.cpu() - want_o).abs().max() < 1e-3 * want_o.abs().max()
    assert (s.cpu() - want_s).abs().max() < 1e-3 * want_s.abs().max()
