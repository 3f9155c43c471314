"""gpt-oss's experts in the quantized CPU kernel (freetoken/kernels/cpu/expert_quant.cpp with
biases and the clamped SwiGLU, freetoken/kernels/expert_act.py), under every build this CPU runs,
against the float64 reference. The bank is read through slot rows while the biases follow the
logical ids (as a slot-cache backend calls it): a kernel that took the bias row from the bank row
would differ. The case drives gate and up past the SwiGLU limit on both sides, so the clamps
count."""
from __future__ import annotations

import pytest
import torch

from freetoken.kernels.cpu.expert_ops import cpu_experts_torch, run_quant
from freetoken.kernels.cpu.ext import CpuKernel
from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.quant import quantize_bank
from freetoken.kernels.reference import expert_ffn_reference
from tests.kernels.cpu.test_expert_quant import quant_isas, quant_kernel


@pytest.fixture(scope="module", params=quant_isas())
def isa_kernel(request: pytest.FixtureRequest) -> CpuKernel:
    return quant_kernel(request.param)


def _case(fmt: str, T: int, seed: int = 0, H=96, I=64, E=6, K=3):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, generator=g) * (6.0 / H**0.5)  # gate / up std ~6
    dn = torch.randn(E, H, I, generator=g) / I**0.5
    gub, dnb = torch.randn(E, 2 * I, generator=g) * 2.0, torch.randn(E, H, generator=g)
    act = ExpertAct(1.702, 7.0, gub, dnb)
    logical = torch.randint(0, E, (T, K), generator=g)  # [T, K] the routed experts
    slot_of = torch.randperm(E, generator=g)  # expert e sits in slot slot_of[e]
    slots = slot_of[logical]  # [T, K] the bank rows the kernel reads
    qgu, qdn = quantize_bank(gu, fmt, 32, 2), quantize_bank(dn, fmt, 32, 1)
    inv = torch.argsort(slot_of)  # slot s holds expert inv[s]
    bank_gu, bank_dn = qgu.index_select(0, inv), qdn.index_select(0, inv)
    x = torch.randn(T, H, generator=g)
    mask = torch.rand(T, K, generator=g) < 0.85
    mask[0, 0] = True
    return x, slots, bank_gu, bank_dn, mask, act.bind(logical), (qgu, gub, x, logical)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 7])
def test_quant_kernel_act_matches_reference(isa_kernel, fmt: str, T: int) -> None:
    x, slots, gu, dn, mask, act, (qgu, gub, _, logical) = _case(fmt, T, seed=T)
    # the case reaches both clamps: gate above the limit, up beyond ±limit
    pre = torch.einsum("th,tkrh->tkr", x, qgu.dequantize()[logical]) + gub[logical]
    gate, up = pre[..., :64], pre[..., 64:]
    assert (gate > 7).any() and (up > 7).any() and (up < -7).any() and (gate < 7).any()
    ref = expert_ffn_reference(x, slots, gu, dn, mask, act)  # [T, K, H] float64
    out = torch.full(ref.shape, float("nan"))
    run_quant(isa_kernel, x, slots, gu, dn, mask, out, num_threads=2, act=act)
    assert torch.isnan(out[~mask]).all()
    assert _rel(out[mask], ref[mask]) < 2e-6, isa_kernel.built_isa
    # biases by bank row instead of logical id: a different function (the test can fail)
    wrong = ExpertAct(act.alpha, act.limit, act.gate_up_bias, act.down_bias).bind(slots)
    assert _rel(expert_ffn_reference(x, slots, gu, dn, mask, wrong)[mask], ref[mask]) > 1e-2
    # the torch fallback computes the same function
    assert _rel(cpu_experts_torch(x, slots, gu, dn, mask, act=act)[mask], ref[mask]) < 2e-6
