"""DeepSeek-V4's experts (ExpertAct kind "clamp": silu(min(g, limit)) * clamp(u, ±limit), no
biases; freetoken/kernels/expert_act.py) on the CPU against the float64 oracle: the dense C++
kernel (expert_kernel.cpp's decode path and expert_tiles.cpp's tiles, dpbf16 included, fp32 and
bf16 banks) and the quantized one (expert_quant.cpp, FP8 and MXFP4) under every build this CPU
runs (AVX-512, AVX2, scalar), and the torch paths (grouped F.linear, the gathered GEMVs, the
dispatcher). The weights put about a third of the gate and up pre-activations past +limit and a
third below -limit, so a missing or one-sided clamp fails
(tests/kernels/triton/moe/test_fused_moe_clamp.py checks the oracle's sensitivity)."""
from __future__ import annotations

import pytest
import torch

from freetoken.experts.ffn import dispatch_experts, expert_group_forward, gathered_experts
from freetoken.kernels.cpu.expert_ops import cpu_experts, cpu_experts_torch, run_quant
from freetoken.kernels.cpu.ext import CpuKernel, load_kernel
from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.quant import quantize_bank
from freetoken.kernels.reference import expert_ffn_reference
from tests.kernels.cpu.test_expert_ops import isa_kernel  # noqa: F401  (every build)
from tests.kernels.cpu.test_expert_quant import quant_isas, quant_kernel

LIMIT = 1.5
CLAMP = ExpertAct.clamp(LIMIT)


@pytest.fixture(scope="module", params=quant_isas())
def quant_isa_kernel(request: pytest.FixtureRequest) -> CpuKernel:
    return quant_kernel(request.param)


def _case(T: int, dtype: torch.dtype, seed: int = 0, H: int = 70, I: int = 40, E: int = 3,
          K: int = 4):
    """Odd H, I (vector tails); E < K so experts repeat in a row and groups pass the decode
    tile (the tile path, and dpbf16 for bf16 from 4 tokens a group)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gu = (torch.randn(E, 2 * I, H, generator=g) * (3.0 / H**0.5)).to(dtype)  # gate / up std ~3
    dn = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=g)
    mask = torch.rand(T, K, generator=g) < 0.8
    mask[0, 0] = True
    pre = torch.einsum("th,tkrh->tkr", x.double(), gu.double()[ids])[mask]  # [n, 2I]
    for side in (pre[:, :I] > LIMIT, pre[:, :I] < -LIMIT, pre[:, I:] > LIMIT,
                 pre[:, I:] < -LIMIT):
        assert side.double().mean() > 0.2  # every clamp bites
    return x, ids, gu, dn, mask


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_dense_kernel_clamp_matches_reference(isa_kernel, dtype, T) -> None:  # noqa: F811
    x, ids, gu, dn, mask = _case(T, dtype, seed=T)
    ref = expert_ffn_reference(x, ids, gu, dn, mask, CLAMP)  # [T, K, H] float64
    assert _rel(expert_ffn_reference(x, ids, gu, dn, mask)[mask], ref[mask]) > 0.1
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: dpbf16 rounds the activations
    for dp in (False, True):
        out = torch.full(ref.shape, float("nan"))
        isa_kernel.run(x, ids, gu, dn, mask, out, num_threads=2, allow_dpbf16=dp, act=CLAMP)
        assert torch.isnan(out[~mask]).all()
        assert _rel(out[mask], ref[mask]) < tol, (isa_kernel.built_isa, dp)


def test_dense_kernel_refuses_biases() -> None:
    kern = load_kernel()
    if kern is None:
        pytest.skip("no C++ kernel here")
    x, ids, gu, dn, _ = _case(1, torch.float32)
    oai = ExpertAct(1.702, LIMIT, torch.zeros(3, 80), torch.zeros(3, 70)).bind(ids)
    with pytest.raises(ValueError, match="oai"):
        kern.run(x, ids, gu, dn, None, torch.zeros(1, 4, 70), act=oai)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 9])
def test_cpu_experts_takes_the_kernel_under_clamp(dtype, T) -> None:
    """cpu_experts sends a "clamp" act to the C++ kernel (not the torch fallback) and both
    equal the oracle."""
    kern = load_kernel()
    if kern is None:
        pytest.skip("no C++ kernel here")
    x, ids, gu, dn, mask = _case(T, dtype, seed=20 + T)
    ref = expert_ffn_reference(x, ids, gu, dn, mask, CLAMP)
    got = cpu_experts(x, ids, gu, dn, mask, num_threads=2, act=CLAMP)
    direct = torch.zeros(ref.shape)
    kern.run(x, ids, gu, dn, mask, direct, num_threads=2, act=CLAMP)
    assert torch.equal(got, direct)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(got[mask], ref[mask]) < tol
    assert _rel(cpu_experts_torch(x, ids, gu, dn, mask, act=CLAMP)[mask], ref[mask]) < tol


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 7])
def test_quant_kernel_clamp_matches_reference(quant_isa_kernel, fmt, T) -> None:
    x, ids, gu, dn, mask = _case(T, torch.float32, seed=30 + T, H=96, I=64, E=6, K=3)
    qgu, qdn = quantize_bank(gu, fmt, 32, 2), quantize_bank(dn, fmt, 32, 1)
    ref = expert_ffn_reference(x, ids, qgu, qdn, mask, CLAMP)
    assert _rel(expert_ffn_reference(x, ids, qgu, qdn, mask)[mask], ref[mask]) > 0.1
    out = torch.full(ref.shape, float("nan"))
    run_quant(quant_isa_kernel, x, ids, qgu, qdn, mask, out, num_threads=2, act=CLAMP)
    assert torch.isnan(out[~mask]).all()
    assert _rel(out[mask], ref[mask]) < 2e-6, quant_isa_kernel.built_isa
    assert _rel(cpu_experts_torch(x, ids, qgu, qdn, mask, act=CLAMP)[mask], ref[mask]) < 2e-6
    if load_kernel() is not None:  # the dispatcher takes the quantized kernel with the act
        got = cpu_experts(x, ids, qgu, qdn, mask, num_threads=2, act=CLAMP)
        assert _rel(got[mask], ref[mask]) < 2e-6


@pytest.mark.parametrize("T", [1, 6])
def test_torch_paths_clamp(T) -> None:
    """The gathered GEMVs, the grouped dispatcher (T = 1: the C++ kernel's decode row) and one
    expert's group forward, fp32 on the CPU."""
    x, ids, gu, dn, mask = _case(T, torch.float32, seed=40 + T)
    ids = torch.where(mask, ids, -1)  # ids < 0: no expert
    ref = expert_ffn_reference(x, ids, gu, dn, act=CLAMP)  # zeros where ids < 0
    act = CLAMP.bind(ids)
    for fn in (gathered_experts, dispatch_experts):
        y = torch.zeros(ref.shape)
        fn(x, ids, gu, dn, y, act=act)
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5), fn.__name__
    t, k = mask.nonzero()[0].tolist()
    e = int(ids[t, k])
    one = expert_group_forward(x[t:t + 1], gu[e], dn[e], act=CLAMP)  # [1, H]
    assert torch.allclose(one[0].double(), ref[t, k], rtol=1e-5, atol=1e-5)
