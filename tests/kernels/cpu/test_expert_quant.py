"""The CPU expert kernel over FP8 block-scaled and MXFP4 banks
(freetoken/kernels/cpu/expert_quant.cpp),
under every build this CPU runs, against the float64 reference of the dequantized weights."""
from __future__ import annotations

import pytest
import torch

from freetoken.kernels.cpu.expert_ops import cpu_experts, cpu_experts_torch, run_quant
from freetoken.kernels.cpu.ext import CpuKernel, build_emulated, simde_include
from freetoken.kernels.quant import quantize_bank
from freetoken.kernels.reference import expert_ffn_reference
from tests.kernels.cpu.test_expert_ops import _build_runnable, _test_isas

EMULATED = "avx512-simde"  # the AVX-512 paths under SIMDe, where the CPU has no AVX-512


def quant_isas() -> list[str]:
    """The builds this CPU runs, plus the emulated AVX-512 paths when it runs none of them."""
    isas = _test_isas()
    return isas if any(i.startswith("avx512") for i in isas) else [*isas, EMULATED]


def quant_kernel(isa: str) -> CpuKernel:
    if isa != EMULATED:
        return _build_runnable(isa)
    if simde_include() is None:
        pytest.skip("simde-py (a dev dependency) is missing: the AVX-512 paths run only on "
                    "an AVX-512 CPU")
    kern = build_emulated()
    assert kern.built_isa == "avx512"
    return kern


@pytest.fixture(scope="module", params=quant_isas())
def isa_kernel(request: pytest.FixtureRequest) -> CpuKernel:
    return quant_kernel(request.param)


def _case(fmt: str, seed: int, T: int, H=96, I=64, E=5, K=3, block=32):
    g = torch.Generator().manual_seed(seed)
    # a wide range of magnitudes per block: small values land on e4m3 subnormals, and one
    # block per bank holds a large outlier (its own scale)
    gu = torch.randn(E, 2 * I, H, generator=g) / H**0.5 * 0.05
    gu[:, :4, :32] *= 40.0
    dn = torch.randn(E, H, I, generator=g) / I**0.5
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[0, 1] = ids[0, 0]  # a duplicate expert in one row
    mask = torch.rand(T, K, generator=g) < 0.8
    mask[0, 0] = True
    return (x, ids, quantize_bank(gu, fmt, block, 2), quantize_bank(dn, fmt, block, 1), mask)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 2, 7])  # decode, a pair, a prefill-size group (kQnt + 3)
def test_quant_kernel_matches_dequantized_reference(isa_kernel, fmt, T):
    x, ids, gu, dn, mask = _case(fmt, seed=T, T=T)
    ref = expert_ffn_reference(x, ids, gu, dn, mask)  # [T, K, H] float64
    out = torch.full(ref.shape, float("nan"))
    run_quant(isa_kernel, x, ids, gu, dn, mask, out, num_threads=2)
    assert torch.isnan(out[~mask]).all(), "masked-out rows must be left untouched"
    assert _rel(out[mask], ref[mask]) < 2e-6, isa_kernel.built_isa


def test_quant_kernel_fp8_block_128_and_threads(isa_kernel):
    # the released block size, I not a multiple of it (gate and up grids round separately),
    # and a result independent of the thread count
    x, ids, gu, dn, mask = _case("fp8", seed=9, T=1, H=256, I=160, block=128)
    ref = expert_ffn_reference(x, ids, gu, dn, mask)
    outs = []
    for nth in (1, 2, 3):
        out = torch.zeros(ref.shape)
        run_quant(isa_kernel, x, ids, gu, dn, mask, out, num_threads=nth)
        outs.append(out)
    assert _rel(outs[0][mask], ref[mask]) < 2e-6
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_dispatcher_and_fallback_read_quantized_banks(fmt):
    # cpu_experts picks the quantized kernel (or the torch fallback where it cannot build):
    # both the dequantized function; a shape the kernel refuses (H not a multiple of 32)
    # falls back rather than failing
    x, ids, gu, dn, mask = _case(fmt, seed=4, T=3)
    from freetoken.kernels.cpu.expert_ops import _quant_usable

    assert _quant_usable(gu, dn)  # the kernel's case (the fallback is checked just below)
    ref = expert_ffn_reference(x, ids, gu, dn, mask)
    assert _rel(cpu_experts(x, ids, gu, dn, mask)[mask], ref[mask]) < 2e-6
    assert _rel(cpu_experts_torch(x, ids, gu, dn, mask)[mask], ref[mask]) < 2e-6
    if fmt == "fp8":
        x2, ids2, gu2, dn2, m2 = _case(fmt, seed=5, T=1, H=48, I=32, block=16)
        ref2 = expert_ffn_reference(x2, ids2, gu2, dn2, m2)
        assert _rel(cpu_experts(x2, ids2, gu2, dn2, m2)[m2], ref2[m2]) < 2e-6


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quant_decode_layout_prefetch_and_stealing_do_not_change_results(isa_kernel, fmt):
    # decode-size groups take per-thread runs of units with a prefetch cursor and stealing;
    # each output is still one dot product: bit-identical with prefetch / stealing off, with
    # more threads than units to share, and the float64 reference holds
    x, ids, gu, dn, mask = _case(fmt, seed=11, T=2, H=128, I=96)
    ref = expert_ffn_reference(x, ids, gu, dn, mask)
    outs = []
    try:
        for pf, steal, nth in ((True, True, 3), (False, True, 2), (True, False, 3),
                               (True, True, 1), (True, True, 64)):
            isa_kernel.set_prefetch(pf)
            isa_kernel.set_steal(steal)
            out = torch.zeros(ref.shape)
            run_quant(isa_kernel, x, ids, gu, dn, mask, out, num_threads=nth)
            outs.append(out)
    finally:
        isa_kernel.set_prefetch(True)
        isa_kernel.set_steal(True)
    assert _rel(outs[0][mask], ref[mask]) < 2e-6
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_quant_kernel_fp8_huge_scales(isa_kernel):
    # block scales >= 2^8: the kernel cannot fold e4m3's 2^120 rebias into them (fp32
    # overflow) and takes the two-multiply conversion; same function
    x, ids, gu, dn, mask = _case("fp8", seed=6, T=2)
    gu.scale[:, :1] *= 2.0**20  # one row block of gate per expert
    ref = expert_ffn_reference(x, ids, gu, dn, mask)
    out = torch.zeros(ref.shape)
    run_quant(isa_kernel, x, ids, gu, dn, mask, out, num_threads=2)
    assert float(gu.scale.max()) >= 2.0**8
    assert _rel(out[mask], ref[mask]) < 2e-6


def test_quant_kernel_bad_expert_id_raises(isa_kernel):
    x, ids, gu, dn, _ = _case("mxfp4", seed=1, T=1)
    ids[0, 0] = 99
    with pytest.raises(IndexError):
        run_quant(isa_kernel, x, ids, gu, dn, None, torch.zeros(1, 3, 96))
