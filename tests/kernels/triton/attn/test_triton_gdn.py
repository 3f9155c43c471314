"""Gated DeltaNet decode kernels on the state pools in place, against freetoken's torch path
(itself checked against transformers in tests/models) and a float64 recomputation.

Pools are scattered: rows not in `slots` must come back bit-identical, and outputs start NaN.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from freetoken.cache.tensors import StateTensors
from freetoken.kernels.triton.gdn import causal_conv1d_update_pool, gdn_gates, gdn_recurrent_pool
from freetoken.kernels.triton.norm import gated_rmsnorm
from freetoken.layers.gated_delta import recurrent_gated_delta
from freetoken.layers.linear_attention import GatedDeltaNet, _l2norm
from freetoken.types.forward_batch import ForwardBatch
from tests.kernels.triton.attn.helpers import DEVICE, linear_attention_config, rel_err

HK, HV, D = 2, 4, 16


def _recurrent64(q, k, v, g, beta, state):
    """Float64, loop over rows and value heads; q, k [B, Hk, dk] raw; state [B, Hv, dk, dv]."""
    B, hk, dk = q.shape
    r = v.shape[1] // hk
    o = torch.empty(v.shape, dtype=torch.float64)
    s_out = state.double().clone()
    for b in range(B):
        for h in range(v.shape[1]):
            qh, kh = q[b, h // r].double(), k[b, h // r].double()
            qh = qh / torch.sqrt((qh * qh).sum() + 1e-6) * dk ** -0.5
            kh = kh / torch.sqrt((kh * kh).sum() + 1e-6)
            s = s_out[b, h] * torch.exp(g[b, h].double())  # [dk, dv]
            s = s + torch.outer(kh, beta[b, h].double() * (v[b, h].double() - s.T @ kh))
            s_out[b, h] = s
            o[b, h] = s.T @ qh
    return o, s_out


def _torch_path(q, k, v, g, beta, state):
    """What linear_attention.py does: l2norm, repeat_interleave to Hv heads, recurrent step."""
    r = v.shape[1] // q.shape[1]
    qn = _l2norm(q.float()).repeat_interleave(r, dim=1)
    kn = _l2norm(k.float()).repeat_interleave(r, dim=1)
    return recurrent_gated_delta(qn, kn, v, g, beta, state)


@pytest.mark.parametrize("block_v,slot_dtype", [(None, torch.int64), (8, torch.int32)])
def test_recurrent_in_place_matches_torch_and_float64(block_v, slot_dtype) -> None:
    """Three chained steps on slots [5, 0, 7] of a 9-row pool. q/k/v are strided views into
    one conv output row, as the decode step splits it. block_v=8 splits dv in two blocks."""
    gen = torch.Generator().manual_seed(1 if block_v is None else 2)
    B, S = 3, 9
    slots = torch.tensor([5, 0, 7])
    pool = torch.randn(S, HV, D, D, generator=gen) * 0.5  # [S, Hv, dk, dv]
    ref_pool = pool.clone()
    dev_pool = pool.to(DEVICE)
    dev_slots = slots.to(DEVICE, slot_dtype)
    for step in range(3):
        conv_out = torch.randn(B, 2 * HK * D + HV * D, generator=gen)  # [B, C]
        q = conv_out[:, :HK * D].view(B, HK, D)
        k = conv_out[:, HK * D:2 * HK * D].view(B, HK, D)
        v = conv_out[:, 2 * HK * D:].view(B, HV, D)
        g = -torch.rand(B, HV, generator=gen) * 2  # log decay
        beta = torch.rand(B, HV, generator=gen)
        c = conv_out.to(DEVICE)
        out = torch.full((B, HV, D), float("nan"), device=DEVICE)
        got = gdn_recurrent_pool(c[:, :HK * D].view(B, HK, D),
                                 c[:, HK * D:2 * HK * D].view(B, HK, D),
                                 c[:, 2 * HK * D:].view(B, HV, D), g.to(DEVICE),
                                 beta.to(DEVICE), dev_pool, dev_slots, out=out, block_v=block_v)
        assert got is out
        o64, s64 = _recurrent64(q, k, v, g, beta, ref_pool[slots])
        o_ref, s_ref = _torch_path(q, k, v, g, beta, ref_pool[slots])
        assert rel_err(o_ref, o64) <= 1e-5  # the oracle agrees with float64 first
        assert rel_err(got, o_ref) <= 1e-5 and rel_err(got, o64) <= 1e-5, f"step {step}"
        ref_pool[slots] = s_ref
        assert rel_err(dev_pool[slots.to(DEVICE)], s64) <= 1e-5, f"step {step}: state"
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(dev_pool.cpu()[untouched], pool[untouched])


@pytest.mark.parametrize("kc", [4, 2])
def test_conv_update_in_place_matches_decode_branch(kc: int) -> None:
    """Two chained steps on slots [4, 1, 6] of a 7-row pool, C = 48 channels (one masked tile
    of 64). Reference: GatedDeltaNet.forward's decode branch, written out, and float64."""
    gen = torch.Generator().manual_seed(kc)
    B, S, C = 3, 7, 48
    slots = torch.tensor([4, 1, 6])
    pool = torch.randn(S, C, kc - 1, generator=gen)  # [S, C, Kc-1]
    conv_w = torch.randn(C, 1, kc, generator=gen)  # conv1d.weight
    w = conv_w[:, 0, :]  # [C, Kc] strided view, as the layer passes it
    ref_pool, dev_pool = pool.clone(), pool.to(DEVICE)
    for step in range(2):
        x = torch.randn(B, C, generator=gen)
        window = torch.cat([ref_pool[slots], x[:, :, None]], -1)  # [B, C, Kc]
        ref = F.silu((window * w).sum(-1))
        ref64 = F.silu((window.double() * w.double()).sum(-1))
        ref_pool[slots] = window[..., 1:]
        out = torch.full((B, C), float("nan"), device=DEVICE)
        got = causal_conv1d_update_pool(x.to(DEVICE), dev_pool, conv_w.to(DEVICE)[:, 0, :],
                                        slots.to(DEVICE, torch.int32), out=out)
        assert rel_err(got, ref) <= 1e-5 and rel_err(got, ref64) <= 1e-5, f"step {step}"
        assert torch.equal(dev_pool.cpu(), ref_pool), f"step {step}: pool"


def test_decode_step_of_the_layer_equals_torch_forward() -> None:
    """gates, conv -> split -> recurrent -> gated norm -> out_proj with the kernels gives
    GatedDeltaNet.forward on a decode batch of three sequences: output and both pools."""
    cfg = linear_attention_config(HK, HV, D)
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    state = StateTensors(cfg, 6, torch.float32, "cpu")
    for t in (*state.conv, *state.ssm):
        t.copy_(torch.randn_like(t) * 0.5)
    conv0, ssm0 = state.conv[0].clone(), state.ssm[0].clone()
    slot_list = [3, 0, 5]
    batch = ForwardBatch(
        input_ids=torch.zeros(3, dtype=torch.long), positions=torch.tensor([4, 2, 9]),
        new_lens=[1, 1, 1], prefix_lens=[4, 2, 9],
        kv_slots=[torch.arange(5), torch.arange(3), torch.arange(10)],
        state_slots=slot_list, logits_rows=torch.arange(3))
    x = torch.randn(3, cfg.hidden_size)
    with torch.no_grad():
        ref = layer(x, batch, state)
        lay = layer.to(DEVICE)
        xd = x.to(DEVICE)
        conv, ssm = conv0.to(DEVICE), ssm0.to(DEVICE)
        slots = torch.tensor(slot_list, device=DEVICE)
        mixed = lay.in_proj_qkv(xd)  # [B, C]
        z = lay.in_proj_z(xd).view(3, HV, D)
        g, beta = gdn_gates(lay.in_proj_a(xd), lay.in_proj_b(xd), lay.A_log, lay.dt_bias)
        c = causal_conv1d_update_pool(mixed, conv, lay.conv1d.weight[:, 0, :], slots)  # [B, C]
        kd = HK * D
        o = gdn_recurrent_pool(c[:, :kd].view(3, HK, D), c[:, kd:2 * kd].view(3, HK, D),
                               c[:, 2 * kd:].view(3, HV, D), g, beta, ssm, slots)
        y = gated_rmsnorm(o.to(xd.dtype), z, lay.norm.weight, lay.norm.eps)
        got = lay.out_proj(y.reshape(3, HV * D))
    assert rel_err(got, ref) <= 1e-5
    assert rel_err(conv, state.conv[0]) <= 1e-5
    assert rel_err(ssm, state.ssm[0]) <= 1e-5


def test_gates_match_the_layer_and_float64() -> None:
    """g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b); a spans softplus's regimes:
    far below zero (log1p of a tiny exp), around zero, and past torch's threshold of 20."""
    gen = torch.Generator().manual_seed(4)
    B = 3
    a = torch.cat([torch.full((1, HV), -30.0), torch.randn(1, HV, generator=gen),
                   torch.full((1, HV), 25.0)]) + torch.rand(B, HV, generator=gen)
    b = torch.randn(B, HV, generator=gen) * 3
    a_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    g, beta = gdn_gates(a.to(DEVICE), b.to(DEVICE), a_log.to(DEVICE), dt_bias.to(DEVICE))
    g_ref = -a_log.float().exp() * F.softplus(a.float() + dt_bias)  # the layer's expression
    g64 = -a_log.double().exp() * torch.log1p(torch.exp(a.double() + dt_bias.double()))
    for r in range(B):  # per row: the tiny first row must be right relative to itself
        assert rel_err(g[r], g_ref[r]) <= 1e-5 and rel_err(g[r], g64[r]) <= 1e-5, f"row {r}"
    assert beta.dtype == b.dtype and rel_err(beta, torch.sigmoid(b)) <= 1e-6


def test_recurrent_with_raw_gates_equals_gates_then_recurrent() -> None:
    """raw_gates: the decode step hands the projections a, b (strided views of one projection
    row) and the recurrent launch makes g, beta itself; the output and the state equal
    gdn_gates followed by gdn_recurrent_pool exactly (same fp32 math, same roundings). a spans
    softplus's regimes. Bug it catches: gates taken from the wrong head or row, or beta not
    rounded to b's dtype first."""
    gen = torch.Generator().manual_seed(6)
    B, S = 3, 6
    slots = torch.tensor([4, 1, 2], device=DEVICE)
    proj = torch.randn(B, 2 * HV + 3, generator=gen) * 3  # [B, ...] b | a | other columns
    proj[0, HV:2 * HV] = -30.0
    proj[2, HV:2 * HV] = 25.0
    conv_out = torch.randn(B, 2 * HK * D + HV * D, generator=gen).to(DEVICE)
    q = conv_out[:, :HK * D].view(B, HK, D)
    k = conv_out[:, HK * D:2 * HK * D].view(B, HK, D)
    v = conv_out[:, 2 * HK * D:].view(B, HV, D)
    p = proj.to(DEVICE)
    b, a = p[:, :HV], p[:, HV:2 * HV]
    a_log, dt_bias = torch.randn(HV, generator=gen).to(DEVICE), torch.randn(HV, generator=gen)
    dt_bias = dt_bias.to(DEVICE)
    pool = (torch.randn(S, HV, D, D, generator=gen) * 0.5).to(DEVICE)
    pool2 = pool.clone()
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    want = gdn_recurrent_pool(q, k, v, g, beta, pool, slots)
    got = gdn_recurrent_pool(q, k, v, a, b, pool2, slots, raw_gates=(a_log, dt_bias))
    if DEVICE == "cpu":
        assert torch.equal(got, want) and torch.equal(pool2, pool)
    else:  # compiled apart, the two kernels may contract the gate math differently
        assert rel_err(got, want) <= 1e-6 and rel_err(pool2, pool) <= 1e-6
