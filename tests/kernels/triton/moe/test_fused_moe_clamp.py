"""DeepSeek-V4's experts (ExpertAct kind "clamp": silu(min(g, limit)) * clamp(u, ±limit), no
biases; freetoken/kernels/expert_act.py) in the Triton fused MoE's decode and grouped paths and
their quantized twins (ACT 2), against the float64 oracle `expert_ffn_reference(..., act=)`,
under TRITON_INTERPRET=1 on the CPU (fp32, tiny shapes, one tile config each).

The weights are scaled so that about a third of the gate and up pre-activations lie beyond
+limit and a third below -limit: a kernel missing the gate clamp, the up clamp (either side),
or clamping the gate from below too, computes a different function, which
`test_oracle_sees_every_clamp` checks of the oracle itself. Entries with ids < 0 keep y's NaN
poison (or get zeros under zero_missing)."""
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
H, I, S = 64, 32, 8  # hidden, intermediate, bank rows
LIMIT = 1.5
DECODE_SMALL = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 16}, "down": {"BLOCK_N": 32, "BLOCK_K": 16}}
GROUPED_SMALL = (tile(16, 16, 32, 2, 4, 2), tile(16, 32, 16, 1, 4, 2))
CLAMP = ExpertAct.clamp(LIMIT)


def make(T, K, seed, neg=0.25):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gate_up = torch.randn(S, 2 * I, H, generator=g) * (3.0 / H**0.5)  # pre-activations std ~3
    down = torch.randn(S, H, I, generator=g) / I**0.5
    ids = torch.randint(0, S, (T, K), generator=g)
    ids[torch.rand(T, K, generator=g) < neg] = -1
    return x, ids, gate_up, down


def pre_acts(x, ids, gate_up):
    """(gate, up) [n, I] float64 of the entries with ids >= 0."""
    keep = ids >= 0
    w = gate_up.double()[ids[keep]]  # [n, 2I, H]
    xs = x.double()[keep.nonzero()[:, 0]]  # [n, H]
    gu = torch.einsum("nrh,nh->nr", w, xs)
    return gu[:, :I], gu[:, I:]


def on_dev(*ts):
    return [t.to(DEVICE) for t in ts]


def test_oracle_sees_every_clamp():
    """The case reaches both sides of both clamps, and the oracle differs from the plain SwiGLU,
    from each clamp left out, and from a gate clamped below as well (so the kernels' tests
    below fail on any of those mistakes)."""
    x, ids, gu, dn = make(6, 4, 5, neg=0.0)
    g, u = pre_acts(x, ids, gu)
    for share in ((g > LIMIT), (g < -LIMIT), (u > LIMIT), (u < -LIMIT)):
        assert share.double().mean() > 0.2
    want = expert_ffn_reference(x, ids, gu, dn, act=CLAMP)
    downs = dn.double()[ids.reshape(-1)]  # [n, H, I]

    def variant(gg, uu):
        return torch.einsum("nhi,ni->nh", downs, torch.nn.functional.silu(gg) * uu).view_as(want)

    lim = LIMIT
    assert torch.allclose(variant(g.clamp(max=lim), u.clamp(-lim, lim)), want)
    for wrong in (variant(g, u), variant(g, u.clamp(-lim, lim)), variant(g.clamp(max=lim), u),
                  variant(g.clamp(max=lim), u.clamp(max=lim)),
                  variant(g.clamp(-lim, lim), u.clamp(-lim, lim)),
                  expert_ffn_reference(x, ids, gu, dn, act=ExpertAct(
                      1.702, lim, torch.zeros(S, 2 * I), torch.zeros(S, H)))):
        assert (wrong - want).abs().max() > 1e-1


@pytest.mark.parametrize("T,K,seed", [(1, 4, 0), (3, 4, 1), (5, 2, 2)])
def test_decode_clamp_matches_reference(T, K, seed):
    x, ids, gu, dn = make(T, K, seed)
    y0 = torch.full((T, K, H), float("nan"))
    want = act_reference(x, ids, gu, dn, CLAMP, y0)
    xd, idd, gud, dnd, y = on_dev(x, ids, gu, dn, y0)
    fused_moe_decode(xd, idd, gud, dnd, y, DECODE_SMALL, act=CLAMP)
    check_entries(y, want, ids)


@pytest.mark.parametrize("T,K,seed", [(6, 4, 3), (17, 2, 4)])
def test_grouped_clamp_matches_reference(T, K, seed):
    x, ids, gu, dn = make(T, K, seed)
    y0 = torch.full((T, K, H), float("nan"))
    want = act_reference(x, ids, gu, dn, CLAMP, y0)
    xd, idd, gud, dnd, y = on_dev(x, ids, gu, dn, y0)
    # bound to some ids (as a block passes it): "clamp" reads none of them
    act = CLAMP.bind(torch.zeros(1, 1, dtype=torch.int64, device=DEVICE))
    fused_moe_grouped(xd, idd, gud, dnd, y, GROUPED_SMALL, act=act)
    check_entries(y, want, ids)


def test_zero_missing_both_paths():
    x, ids, gu, dn = make(4, 4, 6)
    want = expert_ffn_reference(x, ids, gu, dn, act=CLAMP)  # zeros where ids < 0
    for decode in (True, False):
        xd, idd, gud, dnd = on_dev(x, ids, gu, dn)
        y = torch.full((4, 4, H), float("nan"), device=DEVICE)
        fused_moe(xd, idd, gud, dnd, y, decode=decode, zero_missing=True, act=CLAMP)
        assert torch.allclose(y.double().cpu(), want, rtol=1e-5, atol=1e-5), decode


def test_clamp_with_shared_is_refused():
    x, ids, gu, dn = make(2, 4, 7)
    with pytest.raises(ValueError, match="shared"):
        fused_moe_decode(x, ids, gu, dn, torch.zeros(2, 4, H), act=CLAMP,
                         shared=(gu[0], dn[0], torch.zeros(2, H)))


@pytest.mark.parametrize("fmt,block", [("mxfp4", 32), ("fp8", 16)])
@pytest.mark.parametrize("T,decode", [(3, True), (9, False)])
def test_quant_clamp_matches_reference(fmt, block, T, decode):
    """The quantized twins (moe_quant.py, moe_quant_grouped.py) under "clamp", held to the
    float64 oracle over the dequantized weights."""
    from freetoken.kernels.quant import quantize_bank
    from freetoken.kernels.triton.moe_quant import fused_moe_quant_decode
    from freetoken.kernels.triton.moe_quant_grouped import fused_moe_quant_grouped

    x, ids, gu, dn = make(T, 4, 10 + T)
    qgu, qdn = quantize_bank(gu, fmt, block, 2), quantize_bank(dn, fmt, block, 1)
    g, u = pre_acts(x, ids, qgu.dequantize())
    assert ((g > LIMIT).any() and (u > LIMIT).any() and (u < -LIMIT).any()
            and (g < -LIMIT).any())
    y0 = torch.full((T, 4, H), float("nan"))
    want = act_reference(x, ids, qgu, qdn, CLAMP, y0)
    xd, idd, y = on_dev(x, ids, y0)
    qgu, qdn = qgu.to(DEVICE), qdn.to(DEVICE)
    if decode:
        fused_moe_quant_decode(xd, idd, qgu, qdn, y, DECODE_SMALL, act=CLAMP)
    else:
        fused_moe_quant_grouped(xd, idd, qgu, qdn, y, GROUPED_SMALL, act=CLAMP)
    check_entries(y, want, ids)
