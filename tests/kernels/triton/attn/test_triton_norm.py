"""RMSNorm / residual-add RMSNorm / gated RMSNorm kernels against freetoken.layers.norm (whose
dtype semantics mirror transformers) and a float64 recomputation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from freetoken.kernels.triton.norm import gated_rmsnorm, rmsnorm
from freetoken.layers.norm import GatedRMSNorm, RMSNorm
from tests.kernels.triton.attn.helpers import DEVICE, rel_err

EPS = 1e-6


def _norm64(x: torch.Tensor, w: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    x = x.double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return n * ((1 + w.double()) if zero_centered else w.double())


@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("shape", [(3, 48), (2, 3, 16), (1, 40)])
def test_rmsnorm_matches_module_and_float64(zero_centered: bool, shape) -> None:
    """N = 48 and 40 are not powers of two (masked tail); (2, 3, 16) is a per-head norm."""
    gen = torch.Generator().manual_seed(sum(shape) + zero_centered)
    x = torch.randn(*shape, generator=gen) * 3
    mod = RMSNorm(shape[-1], EPS, zero_centered)
    mod.weight.data = torch.randn(shape[-1], generator=gen) * 0.5
    y = rmsnorm(x.to(DEVICE), mod.weight.data.to(DEVICE), EPS, zero_centered)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert rel_err(y, mod(x)) <= 1e-5
    assert rel_err(y, _norm64(x, mod.weight.data, zero_centered)) <= 1e-5


@pytest.mark.parametrize("zero_centered", [True, False])
def test_residual_add_then_norm(zero_centered: bool) -> None:
    """(y, s) with s = x + residual and y = norm(s): what `x = x + h; norm(x)` gives."""
    gen = torch.Generator().manual_seed(11)
    x, h = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    mod = RMSNorm(48, EPS, zero_centered)
    mod.weight.data = torch.randn(48, generator=gen) * 0.5
    y, s = rmsnorm(h.to(DEVICE), mod.weight.data.to(DEVICE), EPS, zero_centered,
                   residual=x.to(DEVICE))
    assert rel_err(s, x.double() + h.double()) <= 1e-6
    assert rel_err(y, mod(x + h)) <= 1e-5
    assert rel_err(y, _norm64(x.double() + h.double(), mod.weight.data, zero_centered)) <= 1e-5


def test_strided_rows_are_read_in_place() -> None:
    """The q half of the gated q projection ([T, Hq, 2D] -> [..., :D]) is a strided view."""
    gen = torch.Generator().manual_seed(2)
    qg = torch.randn(3, 4, 32, generator=gen)
    q = qg[..., :16]  # [3, 4, 16] row stride 32
    w = torch.randn(16, generator=gen)
    y = rmsnorm(q.to(DEVICE), w.to(DEVICE), EPS, True)
    assert rel_err(y, _norm64(q, w, True)) <= 1e-5


@pytest.mark.parametrize("zero_centered", [True, False])
def test_half_precision_dtype_semantics(zero_centered: bool) -> None:
    """fp16 input with an fp32 weight: zero-centred returns fp16; plain promotes to fp32 after
    rounding norm(x) to fp16 (the qwen3_moe order). Matches the module to its output dtype."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 32, generator=gen) * 2).half()
    mod = RMSNorm(32, EPS, zero_centered)
    mod.weight.data = torch.randn(32, generator=gen) * 0.5
    y = rmsnorm(x.to(DEVICE), mod.weight.data.to(DEVICE), EPS, zero_centered)
    ref = mod(x)
    assert y.dtype == ref.dtype
    tol = 1e-3 if ref.dtype == torch.float16 else 1e-5  # one fp16 rounding apart at most
    assert rel_err(y, ref) <= tol


def test_gated_rmsnorm_matches_module_and_float64() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 4, 16, generator=gen)  # [T, Hv, dv]
    z = torch.randn(3, 4, 16, generator=gen) * 2
    mod = GatedRMSNorm(16, EPS)
    mod.weight.data = torch.randn(16, generator=gen)
    y = gated_rmsnorm(x.to(DEVICE), z.to(DEVICE), mod.weight.data.to(DEVICE), EPS)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, mod(x, z)) <= 1e-5
    assert rel_err(y, _norm64(x, mod.weight.data, False) * F.silu(z.double())) <= 1e-5


@pytest.mark.parametrize("zero_centered,dtype", [(True, torch.float32), (False, torch.float32),
                                                 (True, torch.float16)])
def test_rmsnorm_rope_matches_norm_then_rotary(zero_centered: bool, dtype) -> None:
    """q prologue: the q half of a gated [T, Hq, 2D] projection (a strided view), per-head
    RMSNorm, partial rotary over the first 8 of 16 dims at scattered positions. Oracle: the
    modules (RMSNorm, Rotary.cos_sin, apply_rotary) in the same dtype, and float64."""
    from freetoken.kernels.triton.norm import rmsnorm_rope
    from freetoken.layers.rotary import Rotary, apply_rotary

    gen = torch.Generator().manual_seed(21 + zero_centered)
    qg = (torch.randn(5, 4, 32, generator=gen) * 2).to(dtype)
    q = qg[..., :16]  # [T, Hq, D]
    mod = RMSNorm(16, EPS, zero_centered).to(dtype)
    mod.weight.data = (torch.randn(16, generator=gen) * 0.5).to(dtype)
    cos, sin = Rotary(8, 10000.0).cos_sin(torch.tensor([0, 3, 17, 100, 4095]), dtype)
    got = rmsnorm_rope(q.to(DEVICE), mod.weight.data.to(DEVICE), EPS, zero_centered,
                       cos.to(DEVICE), sin.to(DEVICE))
    ref = apply_rotary(mod(q), cos, sin)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    n = _norm64(q, mod.weight.data, zero_centered)
    ref64 = apply_rotary(n, cos.double(), sin.double())
    if dtype == torch.float32:
        assert rel_err(got, ref) <= 1e-5 and rel_err(got, ref64) <= 1e-5
    else:  # the module's rounding points: bit-exact here (the GPU's sqrt may move one ulp)
        assert rel_err(got, ref) <= 1e-3 and rel_err(got, ref64) <= 5e-3
        if DEVICE == "cpu":
            assert torch.equal(got, ref)


def test_gated_rmsnorm_rounds_fp32_input_to_x_dtype_first() -> None:
    """x_dtype folds the gated DeltaNet's `o.to(model dtype)` into the norm: fp32 x with
    x_dtype=fp16 equals the norm of x.to(fp16) exactly (fp16: the interpreter rounds fp32 ->
    fp16 to nearest as torch does; its bf16 conversion truncates). Bug it catches: the norm
    taken of the unrounded fp32 values, or the output left in fp32."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(3, 4, 16, generator=gen) * 3  # [T, Hv, dv] fp32 core output
    z = torch.randn(3, 4, 16, generator=gen).half()
    w = (1 + 0.3 * torch.randn(16, generator=gen)).half()
    got = gated_rmsnorm(x.to(DEVICE), z.to(DEVICE), w.to(DEVICE), EPS, x_dtype=torch.float16)
    want = gated_rmsnorm(x.half().to(DEVICE), z.to(DEVICE), w.to(DEVICE), EPS)
    assert got.dtype == torch.float16 and torch.equal(got.cpu(), want.cpu())
    mod = GatedRMSNorm(16, EPS).half()  # the torch path (CPU) takes the same argument
    mod.weight.data = w
    ref = mod(x, z, x_dtype=torch.float16)
    assert ref.dtype == torch.float16 and torch.equal(ref, mod(x.half(), z))
    assert rel_err(got.float(), ref.float()) <= 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_rope_store_writes_the_pool_slots(dtype) -> None:
    """The decode K/V write in one launch: k normed + rotated into k_pool[slots], v copied into
    v_pool[slots], exactly what rmsnorm_rope + index_copy_ of both give; every other slot
    untouched (pools poisoned with NaN). k, v are strided views of one qkv projection."""
    from freetoken.kernels.triton.norm import rmsnorm_rope, rmsnorm_rope_store
    from freetoken.layers.rotary import Rotary

    gen = torch.Generator().manual_seed(31)
    T, Hk, D, S = 3, 2, 16, 9
    qkv = (torch.randn(T, 3 * Hk * D, generator=gen) * 2).to(dtype)  # [T, ...] projection
    k = qkv[:, Hk * D:2 * Hk * D].reshape(T, Hk, D)
    v = qkv[:, 2 * Hk * D:].reshape(T, Hk, D)
    w = (torch.randn(D, generator=gen) * 0.5).to(dtype)
    cos, sin = Rotary(8, 10000.0).cos_sin(torch.tensor([5, 0, 77]), dtype)
    slots = torch.tensor([7, 2, 4])
    kp = torch.full((S, Hk, D), float("nan"), dtype=dtype, device=DEVICE)
    vp = torch.full((S, Hk, D), float("nan"), dtype=dtype, device=DEVICE)
    rmsnorm_rope_store(k.to(DEVICE), w.to(DEVICE), EPS, True, cos.to(DEVICE), sin.to(DEVICE),
                       v.to(DEVICE), kp, vp, slots.to(DEVICE))
    want_k = rmsnorm_rope(k.to(DEVICE), w.to(DEVICE), EPS, True, cos.to(DEVICE),
                          sin.to(DEVICE)).cpu()
    kp, vp = kp.cpu(), vp.cpu()
    assert torch.equal(vp[slots], v)
    if DEVICE == "cpu":
        assert torch.equal(kp[slots], want_k)
    else:  # two compiled specializations of the kernel: the same math, maybe not the same FMAs
        assert rel_err(kp[slots], want_k) <= 1e-3
    others = torch.tensor([s for s in range(S) if s not in slots.tolist()])
    assert torch.isnan(kp[others]).all() and torch.isnan(vp[others]).all()
    with pytest.raises(ValueError, match="pools"):
        rmsnorm_rope_store(k, w, EPS, True, cos, sin, v, kp.double(), vp, slots)


def test_gated_rmsnorm_reads_z_in_place_from_the_projection() -> None:
    """The DeltaNet's z is [T, Hv, dv] cut out of the fused input projection (token stride =
    the projection's width): read with its own strides, the result equals the module on a
    contiguous copy. Bug it catches: a token stride taken as Hv·dv (rows of the wrong token)."""
    gen = torch.Generator().manual_seed(23)
    T, HV, DV = 3, 4, 16
    proj = torch.randn(T, 5 * HV * DV + 7, generator=gen)  # [T, W] fused projection
    z = proj[:, 2 * HV * DV:3 * HV * DV].reshape(T, HV, DV)  # a strided view
    assert not z.is_contiguous()
    x = torch.randn(T, HV, DV, generator=gen)
    mod = GatedRMSNorm(DV, EPS)
    mod.weight.data = torch.randn(DV, generator=gen)
    y = gated_rmsnorm(x.to(DEVICE), z.to(DEVICE), mod.weight.data.to(DEVICE), EPS)
    assert rel_err(y, mod(x, z.contiguous())) <= 1e-5
