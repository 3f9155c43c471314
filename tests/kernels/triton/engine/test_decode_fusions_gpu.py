"""On the GPU, at Qwen3.6-35B-A3B shapes in bf16: the decode-step fusions against references
built from the unfused ops, and the fused MoE step captured in a CUDA graph. (The same kernels
run interpreted on tiny fp32 shapes in test_decode_fusions.py and tests/kernels/triton/moe; the
`gpu` marker skips this module without CUDA.)

- the shared expert as T extra entries of the routed decode launches, and alone;
- zero_missing; the router's row mask;
- the combine computing the shared gate's dot and the next layer's input norm;
- o * sigmoid(gate) of the gated attention; K norm + rotary + K/V pool writes in one launch;
- the gated DeltaNet gates inside the recurrent kernel; the gated norm's folded cast.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from freetoken.kernels.reference import expert_ffn_reference
from freetoken.kernels.triton.decode_fusions import moe_combine, sigmoid_gate_mul
from freetoken.kernels.triton.fused_moe import fused_moe, fused_moe_decode, shared_expert_decode
from freetoken.kernels.triton.gdn import gdn_gates, gdn_recurrent_pool
from freetoken.kernels.triton.norm import gated_rmsnorm, rmsnorm, rmsnorm_rope, rmsnorm_rope_store
from freetoken.kernels.triton.router import fused_router

pytestmark = pytest.mark.gpu

H, I, E, K = 2048, 512, 64, 8  # E cut from 256 to keep the banks small
HQ, HK, D = 16, 2, 256
LHK, LHV, LD = 16, 32, 128
BF = torch.bfloat16


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all()
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def moe():
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(BF)
    down = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(BF)
    sgu = (torch.randn(2 * I, H, device="cuda", generator=g) / H**0.5).to(BF)
    sdn = (torch.randn(H, I, device="cuda", generator=g) / I**0.5).to(BF)
    return gate_up, down, sgu, sdn


def _shared(x, gu, dn):
    """The shared expert on every token: the one expert oracle (freetoken/kernels/reference.py,
    float64 from the bf16 weights) over a bank of one. x [T, H], gu [2I, H], dn [H, I] -> [T, H] on
    x's device."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.long)  # [T, 1]
    return expert_ffn_reference(x, ids, gu[None], dn[None])[:, 0].to(x.device)


@pytest.mark.parametrize("T", [1, 4, 16])
def test_shared_expert_in_the_routed_launches(moe, T):
    gate_up, down, sgu, sdn = moe
    x = torch.randn(T, H, device="cuda").to(BF)
    ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices  # [T, K]
    ids[0, 0] = -1
    y = torch.full((T, K, H), float("nan"), device="cuda", dtype=BF)
    ys = torch.empty(T, H, device="cuda", dtype=BF)
    fused_moe_decode(x, ids, gate_up, down, y, zero_missing=True, shared=(sgu, sdn, ys))
    assert (y[0, 0] == 0).all()
    routed = expert_ffn_reference(x, ids, gate_up, down).to(y.device)  # [T, K, H], the rows used
    for t in range(T):
        for k in range(K):
            if int(ids[t, k]) >= 0:
                assert rel(y[t, k], routed[t, k]) < 2e-2, (t, k)
    want = _shared(x, sgu, sdn)
    assert rel(ys, want) < 2e-2
    assert rel(shared_expert_decode(x, sgu, sdn), want) < 2e-2
    y2 = torch.full((T, K, H), float("nan"), device="cuda", dtype=BF)
    fused_moe(x, ids, gate_up, down, y2)  # the routed entries as without the shared ones
    keep = ids >= 0
    assert torch.equal(y2[keep], y[keep]) and torch.isnan(y2[~keep]).all()


def test_fused_moe_step_replays_from_a_cuda_graph(moe):
    """Router with a row mask, routed + shared experts, combine with the gate dot and the next
    norm: captured once, replayed on new inputs, equal to the eager run."""
    gate_up, down, sgu, sdn = moe
    B = 4
    rw = (torch.randn(E, H, device="cuda") / H**0.5).to(BF)
    gw = (torch.randn(1, H, device="cuda") / H**0.5).to(BF)
    nw = (torch.randn(H, device="cuda") * 0.2).to(BF)
    x = torch.randn(B, H, device="cuda").to(BF)
    res = torch.randn(B, H, device="cuda").to(BF)
    mask = torch.tensor([True, True, True, False], device="cuda")

    def step():
        w, ids = fused_router(x, rw, K, True, row_mask=mask)
        y = torch.empty(B, K, H, device="cuda", dtype=BF)
        ys = torch.empty(B, H, device="cuda", dtype=BF)
        fused_moe_decode(x, ids, gate_up, down, y, zero_missing=True, shared=(sgu, sdn, ys))
        return moe_combine(y, w, res, ys, gate_x=x, gate_weight=gw, norm=(nw, 1e-6, True))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(2):
        g = torch.Generator(device="cuda").manual_seed(seed + 10)
        x.copy_(torch.randn(B, H, device="cuda", generator=g).to(BF))
        graph.replay()
        want = step()
        assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])
    # the masked row: residual + gated shared expert only
    gate = torch.sigmoid((x[3:].float() @ gw.float().T).to(BF).float())
    assert rel(want[0][3:], res[3:].double() + gate.double() * _shared(x[3:], sgu, sdn)) < 2e-2


def test_router_row_mask_bf16():
    x = torch.randn(16, H, device="cuda").to(BF)
    rw = (torch.randn(256, H, device="cuda") / H**0.5).to(BF)
    mask = torch.arange(16, device="cuda") % 3 != 0
    w0, ids0 = fused_router(x, rw, K, True)
    w, ids = fused_router(x, rw, K, True, row_mask=mask)
    assert (ids[~mask] == -1).all() and torch.equal(ids[mask], ids0[mask])
    assert torch.equal(w, w0)


def test_combine_gate_dot_and_next_norm_bf16():
    from freetoken.layers.norm import RMSNorm

    T = 5
    y = torch.randn(T, K, H, device="cuda").to(BF)
    w = torch.softmax(torch.randn(T, K, device="cuda"), -1).to(BF)
    res, sh, x = (torch.randn(T, H, device="cuda").to(BF) for _ in range(3))
    gw = (torch.randn(1, H, device="cuda") / H**0.5).to(BF)
    norm = RMSNorm(H, 1e-6, True).cuda().to(BF)
    norm.weight.data.normal_(0, 0.3)
    out, normed = moe_combine(y, w, res, sh, gate_x=x, gate_weight=gw,
                              norm=(norm.weight, 1e-6, True))
    two_step = moe_combine(y, w, res, sh, shared_gate=F.linear(x, gw))  # the previous path
    # the gate dot differs from cuBLAS's only in summation order: one bf16 ulp of the gate
    assert rel(out, two_step) < 2e-2
    # the norm kernel's math; its row sum may reduce in another order (one ulp at most)
    assert rel(normed, rmsnorm(out, norm.weight, 1e-6, True)) < 1e-2
    with torch.no_grad():
        assert rel(normed, norm(out).float()) < 2e-2


def test_attention_gate_and_kv_store_bf16():
    from freetoken.layers.rotary import Rotary

    T, S = 4, 5000
    out = torch.randn(T, HQ, D, device="cuda").to(BF)
    qg = torch.randn(T, HQ, 2 * D, device="cuda").to(BF)
    got = sigmoid_gate_mul(out, qg[..., D:])
    want = out.reshape(T, -1) * torch.sigmoid(qg[..., D:].reshape(T, -1))
    assert rel(got, want) < 1e-2
    qkv = torch.randn(T, 3 * HK * D, device="cuda").to(BF)
    k = qkv[:, HK * D:2 * HK * D].reshape(T, HK, D)
    v = qkv[:, 2 * HK * D:].reshape(T, HK, D)
    kw = (torch.randn(D, device="cuda") * 0.3).to(BF)
    cos, sin = Rotary(D // 4, 1e7).cos_sin(torch.arange(T, device="cuda") * 777, BF)
    slots = torch.randperm(S, device="cuda")[:T]
    kp = torch.randn(S, HK, D, device="cuda").to(BF)
    vp = torch.randn(S, HK, D, device="cuda").to(BF)
    kp2, vp2 = kp.clone(), vp.clone()
    rmsnorm_rope_store(k, kw, 1e-6, True, cos, sin, v, kp, vp, slots)
    kp2.index_copy_(0, slots, rmsnorm_rope(k, kw, 1e-6, True, cos, sin))
    vp2.index_copy_(0, slots, v)
    assert torch.equal(vp, vp2) and rel(kp[slots], kp2[slots]) < 1e-2
    rest = torch.ones(S, dtype=torch.bool, device="cuda")
    rest[slots] = False
    assert torch.equal(kp[rest], kp2[rest])


def test_gdn_raw_gates_and_gated_norm_cast():
    B, S = 4, 12
    c = torch.randn(B, 2 * LHK * LD + LHV * LD, device="cuda").to(BF)
    kd = LHK * LD
    q, k = c[:, :kd].view(B, LHK, LD), c[:, kd:2 * kd].view(B, LHK, LD)
    v = c[:, 2 * kd:].view(B, LHV, LD)
    ab = (torch.randn(B, 2 * LHV, device="cuda") * 4).to(BF)
    b, a = ab[:, :LHV], ab[:, LHV:]
    a_log, dt_bias = torch.randn(LHV, device="cuda"), torch.randn(LHV, device="cuda")
    pool = torch.randn(S, LHV, LD, LD, device="cuda") * 0.1
    pool2 = pool.clone()
    slots = torch.randperm(S, device="cuda")[:B]
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    want = gdn_recurrent_pool(q, k, v, g, beta, pool, slots)
    got = gdn_recurrent_pool(q, k, v, a, b, pool2, slots, raw_gates=(a_log, dt_bias))
    assert rel(got, want) < 1e-5 and rel(pool2, pool) < 1e-5
    z = torch.randn(B, LHV, LD, device="cuda").to(BF)
    nw = (1 + 0.3 * torch.randn(LD, device="cuda")).to(BF)
    assert torch.equal(gated_rmsnorm(got, z, nw, 1e-6, x_dtype=BF),
                       gated_rmsnorm(got.to(BF), z, nw, 1e-6))
