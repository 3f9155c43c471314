"""On the GPU: the Triton attention, gated DeltaNet and norm kernels at Qwen3.6-35B-A3B shapes in
bf16 against fp32 references, and captured in a CUDA graph, replayed on changed slot/index
contents. (The `gpu` marker skips this module without CUDA.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from freetoken.kernels.triton.gdn import causal_conv1d_update_pool, gdn_gates, gdn_recurrent_pool
from freetoken.kernels.triton.norm import gated_rmsnorm, rmsnorm, rmsnorm_rope
from freetoken.kernels.triton.paged_attention import (
    paged_decode_attention,
    paged_prefill_attention,
)
from tests.kernels.triton.attn.helpers import paged_kv

pytestmark = pytest.mark.gpu

HQ, HK, D = 16, 2, 256  # full attention
LHK, LHV, LD, KC = 16, 32, 128, 4  # gated DeltaNet
C = 2 * LHK * LD + LHV * LD  # 8192 conv channels
BF = torch.bfloat16


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all()
    return float((got - ref).abs().max() / ref.abs().max())


def _attn_ref(q, k_pool, v_pool, slots, first_limit, scale):
    """fp32. q [n, Hq, D]; keys at `slots`; query i sees keys 0..first_limit+i."""
    k = k_pool[slots].float().repeat_interleave(HQ // HK, dim=1)  # [L, Hq, D]
    v = v_pool[slots].float().repeat_interleave(HQ // HK, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale  # [Hq, n, L]
    n, L = q.shape[0], k.shape[0]
    allowed = torch.arange(L, device=q.device)[None] <= first_limit + torch.arange(
        n, device=q.device)[:, None]
    return torch.einsum("hnl,lhd->nhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("num_splits", [None, 1, 32])
def test_decode_attention_bf16_real_shapes(num_splits) -> None:
    lengths = [1, 100, 4097, 33000]
    k_pool, v_pool, indptr, idx = paged_kv(lengths, HK, D)
    q = torch.randn(len(lengths), HQ, D, device="cuda", dtype=BF) * 2
    out = paged_decode_attention(q, k_pool, v_pool, indptr, idx, D ** -0.5,
                                 num_splits=num_splits)
    for b, L in enumerate(lengths):
        slots = idx[indptr[b]:indptr[b + 1]].long()
        ref = _attn_ref(q[b:b + 1], k_pool, v_pool, slots, L - 1, D ** -0.5)[0]
        assert rel(out[b], ref) < 1e-2, f"L={L}"


def test_prefill_attention_bf16_real_shapes() -> None:
    news, lengths = [300, 77, 1], [300, 1100, 50]
    k_pool, v_pool, kv_indptr, idx = paged_kv(lengths, HK, D, seed=1)
    qo = torch.tensor([0] + news, device="cuda").cumsum(0).int()
    q = torch.randn(sum(news), HQ, D, device="cuda", dtype=BF) * 2
    out = paged_prefill_attention(q, k_pool, v_pool, qo, kv_indptr, idx, D ** -0.5)
    for b, (n, L) in enumerate(zip(news, lengths)):
        slots = idx[kv_indptr[b]:kv_indptr[b + 1]].long()
        ref = _attn_ref(q[qo[b]:qo[b + 1]], k_pool, v_pool, slots, L - n, D ** -0.5)
        assert rel(out[qo[b]:qo[b + 1]], ref) < 1e-2, f"n={n} L={L}"


def _gdn_torch(c, g, beta, ssm_pool, slots):
    """The torch decode path (linear_attention.py) in fp32 from the same bf16 conv output."""
    from freetoken.layers.gated_delta import recurrent_gated_delta
    from freetoken.layers.linear_attention import _l2norm

    B, kd, r = c.shape[0], LHK * LD, LHV // LHK
    q = _l2norm(c[:, :kd].float().view(B, LHK, LD)).repeat_interleave(r, dim=1)
    k = _l2norm(c[:, kd:2 * kd].float().view(B, LHK, LD)).repeat_interleave(r, dim=1)
    return recurrent_gated_delta(q, k, c[:, 2 * kd:].view(B, LHV, LD), g, beta, ssm_pool[slots])


def _gdn_inputs(B, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    c = torch.randn(B, C, device="cuda", dtype=BF, generator=gen)
    g = -torch.rand(B, LHV, device="cuda", generator=gen)
    beta = torch.rand(B, LHV, device="cuda", generator=gen)
    return c, g, beta


def _gdn_kernel(c, g, beta, ssm_pool, slots):
    B, kd = c.shape[0], LHK * LD
    return gdn_recurrent_pool(c[:, :kd].view(B, LHK, LD), c[:, kd:2 * kd].view(B, LHK, LD),
                              c[:, 2 * kd:].view(B, LHV, LD), g, beta, ssm_pool, slots)


def test_gdn_recurrent_real_shapes() -> None:
    B, S = 8, 40
    pool = torch.randn(S, LHV, LD, LD, device="cuda") * 0.1
    slots = torch.randperm(S, device="cuda")[:B]
    c, g, beta = _gdn_inputs(B, 0)
    o_ref, s_ref = _gdn_torch(c, g, beta, pool, slots)
    before = pool.clone()
    o = _gdn_kernel(c, g, beta, pool, slots)
    assert rel(o, o_ref) < 1e-4 and rel(pool[slots], s_ref) < 1e-4
    rest = torch.ones(S, dtype=torch.bool, device="cuda")
    rest[slots] = False
    assert torch.equal(pool[rest], before[rest])


def test_conv_update_real_shapes() -> None:
    B, S = 8, 20
    pool = torch.randn(S, C, KC - 1, device="cuda", dtype=BF)
    w = torch.randn(C, 1, KC, device="cuda", dtype=BF)[:, 0, :]
    x = torch.randn(B, C, device="cuda", dtype=BF)
    slots = torch.randperm(S, device="cuda")[:B]
    window = torch.cat([pool[slots], x[:, :, None]], -1)  # [B, C, Kc] bf16
    ref = F.silu((window.float() * w.float()).sum(-1))
    out = causal_conv1d_update_pool(x, pool, w, slots)
    assert out.dtype == BF and rel(out, ref) < 1e-2
    assert torch.equal(pool[slots], window[..., 1:])


def test_norms_bf16_real_shapes() -> None:
    from freetoken.layers.norm import GatedRMSNorm, RMSNorm

    x, h = (torch.randn(7, 2048, device="cuda", dtype=BF) for _ in range(2))
    mod = RMSNorm(2048, 1e-6, True).cuda().to(BF)
    mod.weight.data.normal_(0, 0.3)
    y, s = rmsnorm(h, mod.weight, 1e-6, True, residual=x)
    assert torch.equal(s, x + h)
    # bf16 against bf16: two roundings of nearly the same fp32 value, at most one ulp (2^-7)
    assert rel(y, mod(x + h).float()) < 2e-2
    q = torch.randn(7, HQ, 2 * D, device="cuda", dtype=BF)[..., :D]  # gated q view
    qn = RMSNorm(D, 1e-6, True).cuda().to(BF)
    assert rel(rmsnorm(q, qn.weight, 1e-6, True), qn(q)) < 2e-2
    core, z = (torch.randn(7, LHV, LD, device="cuda", dtype=BF) for _ in range(2))
    gn = GatedRMSNorm(LD, 1e-6).cuda().to(BF)
    assert rel(gated_rmsnorm(core, z, gn.weight, 1e-6), gn(core.float(), z.float())) < 1e-2


def test_gates_and_qk_prologue_real_shapes() -> None:
    from freetoken.layers.norm import RMSNorm
    from freetoken.layers.rotary import Rotary, apply_rotary

    a, b = (torch.randn(8, LHV, device="cuda", dtype=BF) * 4 for _ in range(2))
    a_log, dt_bias = torch.randn(LHV, device="cuda"), torch.randn(LHV, device="cuda")
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    assert rel(g, -a_log.exp() * F.softplus(a.float() + dt_bias)) < 1e-5
    assert beta.dtype == BF and rel(beta, torch.sigmoid(b.float())) < 1e-2
    q = torch.randn(8, HQ, 2 * D, device="cuda", dtype=BF)[..., :D]  # gated q half
    qn = RMSNorm(D, 1e-6, True).cuda().to(BF)
    qn.weight.data.normal_(0, 0.3)
    cos, sin = Rotary(D // 4, 1e7).cos_sin(torch.arange(8, device="cuda") * 999, BF)
    got = rmsnorm_rope(q, qn.weight, 1e-6, True, cos, sin)
    assert rel(got, apply_rotary(qn(q), cos, sin).float()) < 2e-2  # bf16 vs bf16


def test_decode_kernels_replay_from_cuda_graph() -> None:
    """Attention + conv + recurrent + norm captured once with fixed buffers; each replay after
    rewriting kv_indptr / kv_indices / slots in place gives that step's eager reference."""
    B, S_kv, S_st, cap = 4, 20000, 12, 16000  # cap: preallocated kv_indices capacity
    k_pool = torch.randn(S_kv, HK, D, device="cuda", dtype=BF)
    v_pool = torch.randn(S_kv, HK, D, device="cuda", dtype=BF)
    q = torch.randn(B, HQ, D, device="cuda", dtype=BF)
    indptr = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(cap, dtype=torch.int32, device="cuda")
    ssm = torch.randn(S_st, LHV, LD, LD, device="cuda") * 0.1
    conv = torch.randn(S_st, C, KC - 1, device="cuda", dtype=BF)
    w = torch.randn(C, KC, device="cuda", dtype=BF)
    x = torch.randn(B, C, device="cuda", dtype=BF)
    slots = torch.arange(B, device="cuda")
    g, beta = -torch.rand(B, LHV, device="cuda"), torch.rand(B, LHV, device="cuda")
    hid = torch.randn(B, 2048, device="cuda", dtype=BF)
    nw = torch.randn(2048, device="cuda", dtype=BF) * 0.2

    def step():
        a = paged_decode_attention(q, k_pool, v_pool, indptr, indices, D ** -0.5, num_splits=16)
        c = causal_conv1d_update_pool(x, conv, w, slots)
        return a, c, _gdn_kernel(c, g, beta, ssm, slots), rmsnorm(hid, nw, 1e-6, True)

    indptr.copy_(torch.tensor([0, 1, 2, 3, 4]))
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    gen = torch.Generator().manual_seed(0)
    for it in range(3):
        # at most cap // B keys per row: the step fits the preallocated kv_indices
        lengths = torch.randint(1, min(3000 * (it + 1), cap // B), (B,), generator=gen)
        used = torch.randperm(S_kv, generator=gen)[:int(lengths.sum())]
        indptr.copy_(torch.cat([torch.zeros(1), lengths.cumsum(0)]).int())
        indices[:len(used)].copy_(used)
        slots.copy_(torch.randperm(S_st, generator=gen)[:B])
        for t in (q, x, hid):
            t.normal_()
        conv0, ssm0 = conv.clone(), ssm.clone()
        graph.replay()
        a, c, o, y = outs
        for b in range(B):
            sl = indices[indptr[b]:indptr[b + 1]].long()
            ref = _attn_ref(q[b:b + 1], k_pool, v_pool, sl, int(lengths[b]) - 1, D ** -0.5)[0]
            assert rel(a[b], ref) < 1e-2, f"replay {it} row {b}"
        window = torch.cat([conv0[slots], x[:, :, None]], -1)
        assert rel(c, F.silu((window.float() * w.float()).sum(-1))) < 1e-2
        assert torch.equal(conv[slots], window[..., 1:])
        o_ref, s_ref = _gdn_torch(c, g, beta, ssm0, slots)
        assert rel(o, o_ref) < 1e-4 and rel(ssm[slots], s_ref) < 1e-4
        hf = hid.float()
        ref_y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + nw.float())
        assert rel(y, ref_y) < 1e-2
