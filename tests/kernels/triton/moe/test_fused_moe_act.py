"""gpt-oss's experts (biases by logical id, clamped SwiGLU; freetoken/kernels/expert_act.py) in the
Triton fused MoE's decode and grouped paths, against the float64 oracle
`freetoken.kernels.reference.expert_ffn_reference(..., act=)`, under TRITON_INTERPRET=1 on the CPU.

The bank rows (`ids`, slots) and the logical ids (`act.ids`) are a random permutation apart, so
a kernel that reads the bias of the bank row instead of the logical expert fails. Gate/up values
straddle ±limit (limit is small against the pre-activations), so both clamps are exercised.
Entries with ids < 0 keep y's NaN poison (or get zeros under zero_missing)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.reference import expert_ffn_reference
from freetoken.kernels.triton.fused_moe import fused_moe, fused_moe_decode
from freetoken.kernels.triton.moe_grouped import fused_moe_grouped, tile
from tests.kernels.triton.moe.oracle import act_reference, check_entries

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, S, E = 64, 32, 8, 12  # hidden, intermediate, bank rows, logical experts
DECODE_SMALL = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 16}, "down": {"BLOCK_N": 32, "BLOCK_K": 16}}
GROUPED_SMALL = (tile(16, 16, 32, 2, 4, 2), tile(16, 32, 16, 1, 4, 2))


def make(T, K, seed, neg=0.25):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gate_up = torch.randn(S, 2 * I, H, generator=g) / H**0.5
    down = torch.randn(S, H, I, generator=g) / I**0.5
    ids = torch.randint(0, S, (T, K), generator=g)  # bank rows
    lid = torch.randint(0, E, (T, K), generator=g)  # logical experts: unrelated to the rows
    ids[torch.rand(T, K, generator=g) < neg] = -1
    act = ExpertAct(1.702, 0.7, torch.randn(E, 2 * I, generator=g),
                    torch.randn(E, H, generator=g)).bind(lid)
    return x, ids, gate_up, down, act


def on_dev(*ts):
    return [t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("T,K,seed", [(1, 4, 0), (3, 4, 1), (5, 2, 2)])
def test_decode_act_matches_reference(T, K, seed):
    x, ids, gu, dn, act = make(T, K, seed)
    y0 = torch.full((T, K, H), float("nan"))
    want = act_reference(x, ids, gu, dn, act, y0)
    xd, idd, gud, dnd, y = on_dev(x, ids, gu, dn, y0)
    fused_moe_decode(xd, idd, gud, dnd, y, DECODE_SMALL, act=act.to(DEVICE))
    check_entries(y, want, ids)


@pytest.mark.parametrize("T,K,seed", [(6, 4, 3), (17, 2, 4)])
def test_grouped_act_matches_reference(T, K, seed):
    x, ids, gu, dn, act = make(T, K, seed)
    y0 = torch.full((T, K, H), float("nan"))
    want = act_reference(x, ids, gu, dn, act, y0)
    xd, idd, gud, dnd, y = on_dev(x, ids, gu, dn, y0)
    fused_moe_grouped(xd, idd, gud, dnd, y, GROUPED_SMALL, act=act.to(DEVICE))
    check_entries(y, want, ids)


def test_act_is_not_the_plain_swiglu_and_clamps_bind():
    """The oracle itself is sensitive here: the act output differs from the plain SwiGLU, and
    from the act with the biases taken by bank row (so the ids test above can fail)."""
    x, ids, gu, dn, act = make(4, 4, 5, neg=0.0)
    a = expert_ffn_reference(x, ids, gu, dn, act=act)
    plain = expert_ffn_reference(x, ids, gu, dn)
    by_row = expert_ffn_reference(x, ids, gu, dn, act=act.bind(ids))
    assert (a - plain).abs().max() > 1e-2 and (a - by_row).abs().max() > 1e-2
    pre = torch.einsum("sih,th->tsi", gu.double(), x.double())  # [T, S, 2I]
    assert (pre.abs() > act.limit).float().mean() > 0.2  # the clamps bite


def test_zero_missing_and_dispatch_both_paths():
    x, ids, gu, dn, act = make(4, 4, 6)
    want = expert_ffn_reference(x, ids, gu, dn, act=act)  # zeros where ids < 0
    for decode in (True, False):
        xd, idd, gud, dnd = on_dev(x, ids, gu, dn)
        y = torch.full((4, 4, H), float("nan"), device=DEVICE)
        fused_moe(xd, idd, gud, dnd, y, decode=decode, zero_missing=True, act=act.to(DEVICE))
        assert torch.allclose(y.double().cpu(), want, rtol=1e-5, atol=1e-5), decode


def test_bad_act_binding_is_refused():
    x, ids, gu, dn, act = make(2, 4, 7)
    y = torch.zeros(2, 4, H)
    with pytest.raises(ValueError, match="bind"):
        fused_moe_decode(x, ids, gu, dn, y, act=ExpertAct(1.0, 1.0, act.gate_up_bias,
                                                          act.down_bias))
    with pytest.raises(ValueError, match="entries"):
        fused_moe_decode(x, ids, gu, dn, y, act=act.bind(act.ids[:1]))
    with pytest.raises(ValueError, match="shared"):
        fused_moe_decode(x, ids, gu, dn, y, act=act,
                         shared=(gu[0], dn[0], torch.zeros(2, H)))


@pytest.mark.parametrize("fmt,block", [("mxfp4", 32), ("fp8", 16)])
@pytest.mark.parametrize("T,decode", [(3, True), (9, False)])
def test_quant_act_matches_reference(fmt, block, T, decode):
    """The quantized twins (moe_quant.py, moe_quant_grouped.py) with an act, held to the
    float64 oracle over the dequantized weights (gpt-oss ships MXFP4 experts)."""
    from freetoken.kernels.quant import quantize_bank
    from freetoken.kernels.triton.moe_quant import fused_moe_quant_decode
    from freetoken.kernels.triton.moe_quant_grouped import fused_moe_quant_grouped

    x, ids, gu, dn, act = make(T, 4, 10 + T)
    qgu, qdn = quantize_bank(gu, fmt, block, 2), quantize_bank(dn, fmt, block, 1)
    y0 = torch.full((T, 4, H), float("nan"))
    want = act_reference(x, ids, qgu, qdn, act, y0)
    xd, idd, y = on_dev(x, ids, y0)
    qgu, qdn, a = qgu.to(DEVICE), qdn.to(DEVICE), act.to(DEVICE)
    if decode:
        fused_moe_quant_decode(xd, idd, qgu, qdn, y, DECODE_SMALL, act=a)
    else:
        fused_moe_quant_grouped(xd, idd, qgu, qdn, y, GROUPED_SMALL, act=a)
    check_entries(y, want, ids)
