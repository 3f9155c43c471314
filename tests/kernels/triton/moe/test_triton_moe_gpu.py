"""On the GPU: our Triton fused MoE and router at the Qwen3.6-35B-A3B shape (bf16, H=2048,
I=512, top-8) against the one expert oracle (freetoken/kernels/reference.py, float64) on a sample of
tokens (oracle.py: the rows they route to, every entry still checked written or left alone),
CUDA-graph capture of the decode path, and no host syncs on either path. The CPU runs the same
kernels, and the same sampled check, under the interpreter in tests/kernels/triton/moe.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernels.triton.fused_moe import fused_moe, moe_sum
from freetoken.kernels.triton.moe_grouped import moe_align, moe_align_small
from freetoken.kernels.triton.router import fused_router
from tests.kernels.triton.moe.oracle import check_sampled

pytestmark = pytest.mark.gpu

H, I, K = 2048, 512, 8
# 1100 slots: gate_up holds 1100*1024*2048 > 2**31 elements, so bank offsets need int64
S = 1100


@pytest.fixture(scope="module")
def banks():
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(S, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
    down = (torch.randn(S, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
    return gate_up, down


def route(T: int, seed: int, neg: float = 0.2) -> torch.Tensor:
    """ids [T, K]: K distinct rows per token, biased to the top rows (past the int32 range)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(T, S, device="cuda", generator=g).topk(K, dim=-1).indices  # [T, K]
    ids[:, 0] = S - 1 - torch.arange(T, device="cuda") % 7
    ids[torch.rand(T, K, device="cuda", generator=g) < neg] = -1
    return ids


@pytest.mark.parametrize("T,decode", [(1, True), (4, True), (16, True), (16, False),
                                      (300, False)])
def test_bf16_real_shape_matches_the_oracle(banks, T, decode):
    """Every entry written or left alone; 8 sampled tokens (the first, the last: each token's
    first row is one of the top 7, past the int32 offsets) within bf16 rounding of float64."""
    gate_up, down = banks
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids = route(T, T)
    y = torch.full((T, K, H), float("nan"), device="cuda", dtype=torch.bfloat16)
    fused_moe(x, ids, gate_up, down, y, decode=decode)
    check_sampled(y, x, ids, gate_up, down, rel_tol=1e-2, worst_tol=2e-2, seed=T)


@pytest.mark.parametrize("T,decode", [(4, True), (16, False)])
def test_replays_from_a_cuda_graph(banks, T, decode):
    """Captured once, replayed with new ids and x: the same result as eager calls. The grouped
    path at N <= 128 (one-program alignment) must capture as well as the decode path."""
    gate_up, down = banks
    x_in = torch.zeros(T, H, device="cuda", dtype=torch.bfloat16)
    ids_in = torch.zeros(T, K, device="cuda", dtype=torch.int64)
    y = torch.zeros(T, K, H, device="cuda", dtype=torch.bfloat16)
    fused_moe(x_in, ids_in, gate_up, down, y, decode=decode)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x_in, ids_in, gate_up, down, y, decode=decode)
    for step in range(3):
        x = torch.randn(T, H, device="cuda").bfloat16()
        ids = route(T, 100 + step)
        x_in.copy_(x)
        ids_in.copy_(ids)
        y.fill_(7.0)
        graph.replay()
        want = torch.full_like(y, 7.0)
        fused_moe(x, ids, gate_up, down, want, decode=decode)
        assert torch.equal(y, want), f"step {step}: replay differs from eager"


def torch_router(x, weight, top_k, renormalize):
    """Router.forward's torch path, written out: on CUDA the Router itself now calls
    fused_router, so it cannot be the oracle here."""
    probs = F.softmax(F.linear(x, weight), dim=-1, dtype=torch.float)  # [T, E]
    w, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.to(x.dtype), ids


def test_router_matches_torch_and_replays(banks):
    E, T = 256, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(E, H, device="cuda", generator=g) / H**0.5).bfloat16()
    w_ref, ids_ref = torch_router(x, weight, K, True)
    w, ids = fused_router(x, weight, K, True)
    logits = F.linear(x, weight).float()  # [T, E] as the Router
    stable = torch.sort(-logits, dim=-1, stable=True).indices[:, :K]  # ties: lowest id first
    assert torch.equal(ids, stable)
    probs = F.softmax(logits, dim=-1)
    kth, next_p = torch.sort(probs, -1, descending=True).values[:, K - 1:K + 1].unbind(-1)
    clear = kth > next_p  # no bf16 tie across the K-th place, where torch may pick either
    assert all(set(a) == set(b) for a, b, c in
               zip(ids.tolist(), ids_ref.tolist(), clear.tolist()) if c)
    torch.testing.assert_close(w[clear].float(), w_ref[clear].float(), rtol=8e-3, atol=1e-6)
    x_in = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w_g, ids_g = fused_router(x_in, weight, K, True)
    x2 = torch.randn(T, H, device="cuda").bfloat16()
    x_in.copy_(x2)
    graph.replay()
    w2, ids2 = fused_router(x2, weight, K, True)
    assert torch.equal(ids_g, ids2) and torch.equal(w_g, w2)


@pytest.mark.parametrize("bm", [16, 64])
def test_align_small_kernel_equals_torch_on_gpu(bm):
    """The one-program alignment against the torch one, many times: a missing barrier between
    its fills and its scatter would show as a race here (the interpreter runs it serially)."""
    for seed in range(20):
        ids = route(16, seed)  # N = 128 entries, rows up to S-1
        want = moe_align(ids, S, bm)
        got = moe_align_small(ids, S, bm)
        for name, a, b in zip(("sorted_entries", "block_row", "total"), want, got):
            assert torch.equal(a, b), f"seed {seed}: {name}"


def test_moe_sum_bf16():
    g = torch.Generator(device="cuda").manual_seed(9)
    y = torch.randn(16, K, H, device="cuda", generator=g).bfloat16()
    w = torch.rand(16, K, device="cuda", generator=g).bfloat16()
    want = (y.double() * w.double()[..., None]).sum(1)
    got = moe_sum(y, w)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("T,decode", [(4, True), (64, False)])
def test_no_host_sync(banks, T, decode):
    """Neither path (nor the router) reads a value back to the host."""
    gate_up, down = banks
    x = torch.randn(T, H, device="cuda").bfloat16()
    ids = route(T, 3)
    y = torch.zeros(T, K, H, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, H, device="cuda").bfloat16()
    fused_moe(x, ids, gate_up, down, y, decode=decode)  # compile first (compiling may sync)
    fused_router(x, weight, K, True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, ids, gate_up, down, y, decode=decode)
        fused_router(x, weight, K, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
