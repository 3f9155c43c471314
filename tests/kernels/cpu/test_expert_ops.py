"""CPU expert kernel and torch fallback against the float64 per-token reference."""
from __future__ import annotations

import pytest
import torch

from freetoken.envs import FT_CPU_ISA
from freetoken.kernels.cpu.expert_ops import cpu_experts, cpu_experts_torch
from freetoken.kernels.cpu.ext import ISAS, CpuKernel, build, detect_isa, runnable_isas
from freetoken.kernels.reference import expert_ffn_reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def _case(seed: int, dtype: torch.dtype, t: int | None = None):
    """Random tiny problem: odd sizes (vector tails), duplicate experts in a row, random mask."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    t = t if t is not None else ri(1, 9)
    k, e, h, i = ri(1, 5), ri(2, 7), ri(5, 70), ri(3, 40)
    x = torch.randn(t, h, generator=g)  # [T, H]
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)  # [E, 2I, H]
    down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)  # [E, H, I]
    ids = torch.randint(0, e, (t, k), generator=g)  # [T, K], duplicates likely (e small)
    if k > 1:
        ids[0, 1] = ids[0, 0]  # a duplicate expert inside one token's row
    mask = torch.rand(t, k, generator=g) < 0.7  # [T, K]
    return x, ids, gate_up, down, mask


def _tol(dtype: torch.dtype) -> float:
    # fp32 weights: fp32 arithmetic. bf16 weights: the kernel widens them exactly; the torch
    # fallback and the dpbf16 path round activations to bf16 (bf16-operand accuracy).
    return 1e-5 if dtype == torch.float32 else 1e-2


def _forced_isa() -> str | None:
    """FT_CPU_ISA=<isa> (docs/testing.md) runs the ISA-specific tests under that build only;
    unset (or `auto`), they run under every build this CPU can run."""
    want = FT_CPU_ISA.get()
    return None if want in ("auto", "torch") else want


def _test_isas() -> list[str]:
    forced = _forced_isa()
    return [forced] if forced else runnable_isas()


def _build_runnable(isa: str) -> CpuKernel:
    if isa not in runnable_isas():
        pytest.skip(f"FT_CPU_ISA={isa}: this CPU lacks its instructions "
                    f"(it runs {', '.join(runnable_isas())})")
    return build(isa)


@pytest.fixture(scope="module")
def kernel() -> CpuKernel:
    """The build the engine would load here (FT_CPU_ISA or the detected best)."""
    return _build_runnable(_forced_isa() or detect_isa())


@pytest.fixture(scope="module", params=_test_isas())
def isa_kernel(request: pytest.FixtureRequest) -> CpuKernel:
    """Each build this CPU runs, for the paths whose shape depends on the ISA (decode tile)."""
    return _build_runnable(request.param)


def _check_against_ref(fn, seed: int, dtype: torch.dtype, t: int | None = None) -> None:
    x, ids, gu, dn, mask = _case(seed, dtype, t)
    ref = expert_ffn_reference(x, ids, gu, dn, mask)  # [T, K, H] float64
    poison = torch.full(ref.shape, float("nan"))
    out = fn(x, ids, gu, dn, mask, poison.clone())
    assert out.dtype == torch.float32
    assert torch.isnan(out[~mask]).all(), "masked-out rows must be left untouched"
    got = out.clone()
    got[~mask] = 0
    assert not torch.isnan(got).any(), "every masked-in row must be written"
    if mask.any():
        assert _rel(got, ref) < _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(12))
def test_kernel_matches_reference(kernel: CpuKernel, seed: int, dtype: torch.dtype) -> None:
    def fn(x, ids, gu, dn, mask, out):
        kernel.run(x, ids, gu, dn, mask, out, num_threads=2)
        return out

    _check_against_ref(fn, seed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_fallback_matches_reference(seed: int, dtype: torch.dtype) -> None:
    _check_against_ref(cpu_experts_torch, seed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_prefill_sized_groups(kernel: CpuKernel, dtype: torch.dtype) -> None:
    """Many tokens per expert (token tiles, the dpbf16 path on bf16 CPUs) stay correct."""
    def fn(x, ids, gu, dn, mask, out):
        kernel.run(x, ids, gu, dn, mask, out, num_threads=2)
        return out

    _check_against_ref(fn, 101, dtype, t=40)


def test_kernel_bf16_fp32_path_is_tight(kernel: CpuKernel) -> None:
    """Decode-size groups widen bf16 weights exactly: fp32 accuracy against the reference."""
    x, ids, gu, dn, _ = _case(7, torch.bfloat16, t=1)
    out = torch.zeros(x.shape[0], ids.shape[1], x.shape[1])
    kernel.run(x, ids, gu, dn, None, out, num_threads=1, allow_dpbf16=False)
    assert _rel(out, expert_ffn_reference(x, ids, gu, dn)) < 1e-5


def test_dispatcher_full_mask_and_fresh_out() -> None:
    x, ids, gu, dn, _ = _case(3, torch.float32)
    out = cpu_experts(x, ids, gu, dn)  # no mask: every entry, fresh zero tensor
    assert _rel(out, expert_ffn_reference(x, ids, gu, dn)) < 1e-5


def test_out_of_range_expert_raises(kernel: CpuKernel) -> None:
    x, ids, gu, dn, _ = _case(4, torch.float32)
    ids[0, 0] = gu.shape[0]
    out = torch.zeros(x.shape[0], ids.shape[1], x.shape[1])
    with pytest.raises(IndexError):
        kernel.run(x, ids, gu, dn, None, out)
    with pytest.raises(IndexError):
        cpu_experts_torch(x, ids, gu, dn)


def test_all_masked_out_writes_nothing(kernel: CpuKernel) -> None:
    x, ids, gu, dn, _ = _case(5, torch.bfloat16)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    out = torch.full((x.shape[0], ids.shape[1], x.shape[1]), 7.0)
    kernel.run(x, ids, gu, dn, mask, out)
    assert (out == 7.0).all()


# gcc's -m option -> the /proc/cpuinfo flag of the feature it lets the compiler emit
_CPUINFO_FLAG = {"-mavx512f": "avx512f", "-mavx512bw": "avx512bw", "-mavx512vl": "avx512vl",
                 "-mavx512dq": "avx512dq", "-mavx512bf16": "avx512_bf16", "-mavx2": "avx2",
                 "-mfma": "fma", "-mf16c": "f16c"}


def test_detected_isa_is_one_this_cpu_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On x86, a CPU with exactly the features an ISA's build is compiled for gets that build,
    and a CPU missing any one of them gets a lower one (never a build that would SIGILL).
    Bug it catches: the avx512 builds use -mf16c but detection did not require f16c."""
    from freetoken.kernels.cpu import ext

    monkeypatch.setattr(ext.platform, "machine", lambda: "x86_64")
    for isa in ISAS[:-1]:
        needs = {_CPUINFO_FLAG[f] for f in ext._ISA_FLAGS[isa]}
        assert detect_isa(needs | {"sse4_2", "avx"}) == isa
        for missing in needs:
            got = detect_isa(needs - {missing})
            assert ISAS.index(got) > ISAS.index(isa), (isa, missing, got)
    assert detect_isa(set()) == "scalar"
    monkeypatch.setattr(ext.platform, "machine", lambda: "aarch64")
    assert detect_isa({_CPUINFO_FLAG[f] for f in ext._ISA_FLAGS["avx512bf16"]}) == "scalar"


@pytest.mark.parametrize("isa", runnable_isas())
def test_every_code_path_this_cpu_runs(isa: str) -> None:
    """Each ISA build (separate code paths in one source) computes the same function."""
    kern = build(isa)
    assert kern.built_isa == isa
    for seed, dtype in [(20, torch.float32), (21, torch.bfloat16), (22, torch.bfloat16)]:
        def fn(x, ids, gu, dn, mask, out):
            kern.run(x, ids, gu, dn, mask, out, num_threads=2)
            return out

        _check_against_ref(fn, seed, dtype, t=9 if seed == 22 else None)
    # the same build's plain linear and in-place decode attention
    g = torch.Generator().manual_seed(23)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(3, 40, generator=g), torch.randn(70, 40, generator=g).to(dtype)
        out = torch.empty(3, 70)
        kern.linear(x, w, out, num_threads=2)
        torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
        k = torch.randn(50, 2, 32, generator=g).to(dtype)
        v = torch.randn(50, 2, 32, generator=g).to(dtype)
        q, slots = torch.randn(4, 32, generator=g), torch.randperm(50, generator=g)[:37]
        o = torch.empty(4, 32)
        assert kern.decode_attention(q, k, v, slots, 0.2, o, num_threads=2)
        kk = k[slots].double().repeat_interleave(2, dim=1)  # [L, Hq, D]
        vv = v[slots].double().repeat_interleave(2, dim=1)
        p = (torch.einsum("hd,lhd->hl", q.double(), kk) * 0.2).softmax(-1)
        torch.testing.assert_close(o.double(), torch.einsum("hl,lhd->hd", p, vv), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("t", [1, 3])
def test_kernel_decode_blocks_any_thread_count(isa_kernel: CpuKernel, dtype: torch.dtype,
                                               threads: int, t: int) -> None:
    """Decode-size groups (per-thread contiguous row blocks): every thread count, including
    more threads than row blocks, and row counts that are not a multiple of the tile."""
    kernel = isa_kernel
    for seed in (30, 31, 32):
        def fn(x, ids, gu, dn, mask, out):
            kernel.run(x, ids, gu, dn, mask, out, num_threads=threads, allow_dpbf16=False)
            return out

        _check_against_ref(fn, seed, dtype, t=t)
        if dtype == torch.bfloat16:  # exact widening: fp32 accuracy
            x, ids, gu, dn, _ = _case(seed, dtype, t)
            out = torch.zeros(x.shape[0], ids.shape[1], x.shape[1])
            kernel.run(x, ids, gu, dn, None, out, num_threads=threads, allow_dpbf16=False)
            assert _rel(out, expert_ffn_reference(x, ids, gu, dn)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 5, 13])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_decode_stealing_does_not_change_results(isa_kernel: CpuKernel, dtype: torch.dtype,
                                                 threads: int, t: int) -> None:
    """Threads that finish early steal the others' units; each output row is still one dot
    product, so results are bit-identical with stealing off, at any (over)subscription, and
    match the float64 reference. The per-thread timing of the call is reported.
    Regression: t=3 was run against whatever build the CPU had, and on AVX2 (decode tile of 2
    tokens) it never took the decode path, so the suite failed on every AVX2-only machine."""
    kernel = isa_kernel
    if t > kernel.decode_tile_tokens:
        pytest.skip(f"{t} tokens exceed the {kernel.built_isa} decode tile "
                    f"({kernel.decode_tile_tokens}): the tiled path runs, which has no stealing "
                    "(test_decode_tile_boundary checks the switch)")
    g = torch.Generator().manual_seed(40 + t)
    e, k, h, i = 11, 8, 200, 72  # several units per thread and expert, partial last units
    x = torch.randn(t, h, generator=g)
    gu = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    dn = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, K]
    outs = []
    try:
        for steal in (False, True, True):
            kernel.set_steal(steal)
            out = torch.full((t, k, h), float("nan"))
            kernel.run(x, ids, gu, dn, None, out, num_threads=threads, allow_dpbf16=False)
            outs.append(out)
            timing = kernel.last_timing()
            assert len(timing) == threads
            for enter, p1, end, stolen in timing:
                assert 0 <= enter <= p1 <= end and stolen >= 0
            if not steal:
                assert all(row[3] == 0 for row in timing)
    finally:
        kernel.set_steal(True)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert _rel(outs[0], expert_ffn_reference(x, ids, gu, dn)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_tile_boundary(isa_kernel: CpuKernel, dtype: torch.dtype) -> None:
    """DECODE_TILE_TOKENS matches each build's kNtMax: groups of exactly that many tokens take
    the decode path (per-thread timing recorded), one more token takes the tiled path (no
    timing), and both compute the reference function."""
    n = isa_kernel.decode_tile_tokens
    for t, decode in ((n, True), (n + 1, False)):
        g = torch.Generator().manual_seed(50 + t)
        e, k, h, i = 6, 4, 64, 24
        x = torch.randn(t, h, generator=g)
        gu = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
        dn = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, K]
        out = torch.full((t, k, h), float("nan"))
        isa_kernel.run(x, ids, gu, dn, None, out, num_threads=2, allow_dpbf16=False)
        assert len(isa_kernel.last_timing()) == (2 if decode else 0), (isa_kernel.built_isa, t)
        assert _rel(out, expert_ffn_reference(x, ids, gu, dn)) < 1e-5
