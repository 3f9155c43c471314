"""On the GPU: gpt-oss's sink + sliding-window paged decode
(freetoken/kernels/triton/sink_attention.py) at
the gpt-oss-120b attention shape (64 query heads, 8 KV heads, head dim 64, window 128) in bf16
against an fp32 reference, captured in a CUDA graph and replayed on changed CSR contents, and
the tiny gpt-oss model's greedy tokens through the CUDA decode runner (plan `triton_sink`, CUDA
graphs replayed) equal to the eager engine's (torch sink attention). The CPU runs the same
kernel interpreted in tests/kernels/triton/attn/test_triton_sink_attention.py and
tests/kernels/triton/engine/test_gpt_oss_sink_decode.py. (The `gpu` marker skips
this module without CUDA.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from freetoken.kernels.triton.sink_attention import sink_decode_attention
from tests.kernels.triton.attn.helpers import paged_kv

pytestmark = pytest.mark.gpu

HQ, HK, D, W = 64, 8, 64, 128
BF = torch.bfloat16


def _ref(q, k_pool, v_pool, slots, sinks, window):
    """fp32; q [Hq, D] at the last of `slots`."""
    if window:
        slots = slots[-window:]
    k = k_pool[slots].float().repeat_interleave(HQ // HK, dim=1)  # [L, Hq, D]
    v = v_pool[slots].float().repeat_interleave(HQ // HK, dim=1)
    s = torch.einsum("hd,lhd->hl", q.float(), k) * D ** -0.5  # [Hq, L]
    logits = torch.cat([s, sinks.float()[:, None]], -1)
    return torch.einsum("hl,lhd->hd", logits.softmax(-1)[:, :-1], v)


def _rel(got, ref) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all()
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("window", [0, W])
@pytest.mark.parametrize("num_splits", [None, 1, 32])
def test_sink_decode_bf16_real_shapes(window, num_splits) -> None:
    lengths = [1, 100, 4097, 33000]
    k_pool, v_pool, indptr, idx = paged_kv(lengths, HK, D)
    q = torch.randn(len(lengths), HQ, D, device="cuda", dtype=BF)
    sinks = torch.randn(HQ, device="cuda", dtype=BF) * 2
    out = sink_decode_attention(q, k_pool, v_pool, indptr, idx, D ** -0.5, sinks, window,
                                num_splits=num_splits)
    offs = indptr.tolist()
    for b in range(len(lengths)):
        slots = idx[offs[b]:offs[b + 1]].long()
        assert _rel(out[b], _ref(q[b], k_pool, v_pool, slots, sinks, window)) < 2e-2, b


def test_sink_decode_captures_and_replays() -> None:
    lengths = [300, 7]
    k_pool, v_pool, indptr, idx = paged_kv(lengths, HK, D, spare=400)
    q = torch.randn(2, HQ, D, device="cuda", dtype=BF)
    sinks = torch.randn(HQ, device="cuda", dtype=BF)
    out = torch.empty(2, HQ, D, device="cuda", dtype=BF)
    sink_decode_attention(q, k_pool, v_pool, indptr, idx, D ** -0.5, sinks, W, out=out,
                          num_splits=16)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sink_decode_attention(q, k_pool, v_pool, indptr, idx, D ** -0.5, sinks, W, out=out,
                              num_splits=16)
    indptr.copy_(torch.tensor([0, 9, 400], device="cuda", dtype=torch.int32))  # new lengths
    idx.copy_(idx.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    offs = indptr.tolist()
    for b in range(2):
        slots = idx[offs[b]:offs[b + 1]].long()
        assert _rel(out[b], _ref(q[b], k_pool, v_pool, slots, sinks, W)) < 2e-2, b


def test_tiny_gpt_oss_runner_replays_sink_plan(tmp_path) -> None:
    """fp32 greedy tokens: eager engine (torch sink attention) == decode runner with CUDA graphs
    on the `triton_sink` plan, for one request and three together (a padding row); prompts
    longer than the sliding window (6)."""
    from freetoken.engine.core import EngineCore
    from freetoken.models.loader import load_model
    from freetoken.types.api import GenerateRequest, SamplingParams
    from tests.models.fixtures_gpt_oss import build_gpt_oss

    model = load_model(build_gpt_oss(tmp_path), dtype=torch.float32, device="cuda",
                       progress=False)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (20 + 7 * i,), generator=g).tolist() for i in range(3)]

    def tokens(ps, **kw):
        core = EngineCore(model, [], kv_tokens=4096, state_slots=16, max_running=4,
                          chunk_tokens=64, **kw)
        out: dict[int, list[int]] = {i: [] for i in range(len(ps))}
        sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(ps):
            core.add(GenerateRequest(p, sp, [], request_id=f"r{i}"),
                     lambda ev, i=i: out[i].extend(ev.token_ids))
        while core.has_work():
            core.step()
        return [out[i] for i in range(len(ps))], core

    for ps in (prompts[:1], prompts):
        eager, _ = tokens(ps, decode_runner=False)
        graphs, core = tokens(ps, decode_runner=True, cuda_graph=True)
        assert core.runner.attention == "triton_sink"
        assert core.runner.replays > 0
        assert graphs == eager
