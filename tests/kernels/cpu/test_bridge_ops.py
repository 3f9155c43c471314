"""The bridge's native step loop driven by the simulated GPU side (both in C, on two threads),
against per-layer calls of the expert kernel; the OpenMP runtime the kernels link.

Shapes: L layers, B rows, K top-k, H hidden, E experts, I intermediate."""
from __future__ import annotations

import threading

import pytest
import torch

from freetoken.kernels.cpu import ext
from freetoken.kernels.cpu.bridge_ops import NativeBridge, sim_gpu
from freetoken.kernels.cpu.omp import openmp_runtimes
from freetoken.kernels.reference import expert_ffn_reference

L, B, K, H, E, I = 4, 3, 4, 40, 5, 24

kern = ext.load_kernel()
needs_kernel = pytest.mark.skipif(kern is None, reason="C++ CPU kernel unavailable")


def _buffers(io_dtype: torch.dtype, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gu = [(torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16() for _ in range(L)]
    dn = [(torch.randn(E, H, I, generator=g) / I**0.5).bfloat16() for _ in range(L)]
    x = torch.zeros(L, B, H, dtype=io_dtype)
    x[:, :T] = torch.randn(L, T, H, generator=g).to(io_dtype)
    ids = torch.randint(0, E, (L, B, K), generator=g)
    mask = torch.rand(L, B, K, generator=g) < 0.5
    mask[:, T:] = False
    out = torch.zeros(L, B, K, H, dtype=io_dtype)
    go, done = torch.full((L,), -1, dtype=torch.int64), torch.full((L,), -1, dtype=torch.int64)
    return gu, dn, x, ids, mask, out, go, done


@needs_kernel
@pytest.mark.parametrize("io_dtype", [torch.bfloat16, torch.float32])
def test_step_loop_against_simulated_gpu(io_dtype: torch.dtype) -> None:
    """Bug caught: a layer's done flag stored before its results (or a layer computed from the
    previous layer's inputs) when the flags really race between two threads — every layer's
    output must be the kernel's own per-layer result, rounded as torch rounds."""
    T = 2
    gu, dn, x, ids, mask, out, go, done = _buffers(io_dtype, T, seed=0)
    nb = NativeBridge(kern, gu, dn, x, ids, mask, out, go, done, threads=2)
    for seq in (1, 2):
        if seq == 2:  # new inputs for the second step
            x[:, :T] = torch.randn(L, T, H).to(io_dtype)
            ids.copy_(torch.randint(0, E, (L, B, K)))
        got: list = []
        worker = threading.Thread(target=lambda s=seq, g=got: g.append(nb.run_step(s, T, 5.0)))
        worker.start()
        lat = sim_gpu(kern, go, done, seq, gap_s=50e-6, timeout_s=5.0, team_threads=2)
        worker.join(timeout=10)
        assert got and got[0].total_s > 0 and len(lat) == L and min(lat) > 0
        assert done.tolist() == [seq] * L
        for m in range(L):
            want = torch.zeros(T, K, H)
            kern.run(x[m, :T].float(), ids[m, :T], gu[m], dn[m], mask[m, :T], want, 2)
            sel = mask[m, :T]
            assert torch.equal(out[m, :T][sel], want.to(io_dtype)[sel])
            ref = expert_ffn_reference(x[m, :T].float(), ids[m, :T], gu[m], dn[m], sel)
            assert torch.allclose(out[m, :T].double() * sel[..., None], ref, atol=2e-2)


@needs_kernel
def test_step_rows_beyond_the_bucket_are_refused() -> None:
    nb = NativeBridge(kern, *_buffers(torch.bfloat16, 1, seed=1), threads=1)
    with pytest.raises(RuntimeError, match="rc=4"):
        nb.run_step(1, B + 1, 0.1)


@needs_kernel
def test_one_openmp_runtime_in_the_process() -> None:
    """Bug caught: the kernels linking the system's libgomp beside torch's bundled copy (two
    runtimes, two thread pools placed on the same cores)."""
    gomp = [p for p in openmp_runtimes() if "gomp" in p]
    assert len(gomp) == 1, gomp


def test_build_falls_back_to_the_system_openmp(tmp_path, monkeypatch) -> None:
    """Bug caught: a torch whose bundled libgomp cannot be linked leaving the process without
    the C++ kernels; the build must retry with the system runtime."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(ext, "torch_openmp_ldflags", lambda: ["-l:libft_no_such_omp.so.1"])
    k = ext.build("scalar")  # the smallest build; any ISA takes this path
    x, ids = torch.randn(1, H), torch.tensor([[0, 2, 4, 1]])
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    dn = torch.randn(E, H, I, generator=g) / I**0.5
    out = torch.zeros(1, K, H)
    k.run(x, ids, gu, dn, None, out, 1)
    assert torch.allclose(out.double(), expert_ffn_reference(x, ids, gu, dn), atol=1e-5)
    # the failed link and the fallback are two configurations, in two directories; the
    # finished one is recorded, so the next process loads it without ninja (or its lock)
    dirs = sorted(p.parent.name for p in (tmp_path / "freetoken" / "ext" / "scalar").glob("*/*"))
    recorded = list((tmp_path / "freetoken" / "ext" / "scalar").glob("*/built.json"))
    assert len(recorded) == 1 and len(set(dirs)) == 2, (dirs, recorded)
    from torch.utils import cpp_extension

    def no_ninja(**kw):
        raise AssertionError("a finished build went through cpp_extension.load again")

    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    out2 = torch.zeros(1, K, H)
    ext.build("scalar").run(x, ids, gu, dn, None, out2, 1)
    assert torch.equal(out, out2)


def test_a_build_record_is_trusted_only_for_its_own_configuration(tmp_path) -> None:
    """`_built_library` answers only for the key it recorded and a library still there."""
    lib = tmp_path / "ft_expert_kernel_avx2.so"
    lib.write_bytes(b"")
    ext._record_build(tmp_path, "k1", lib)
    assert ext._built_library(tmp_path, "k1") == lib
    assert ext._built_library(tmp_path, "k2") is None  # another configuration: build it
    lib.unlink()
    assert ext._built_library(tmp_path, "k1") is None  # recorded, but the file is gone
    (tmp_path / "built.json").write_text("{not json")
    assert ext._built_library(tmp_path, "k1") is None
    (tmp_path / "built.json").write_text('{"key": "k1", "library": "../elsewhere.so"}')
    assert ext._built_library(tmp_path, "k1") is None
    k = ext._build_key("s", ["-O3"], ["-lgomp"])
    assert k != ext._build_key("s", ["-O3"], ["-fopenmp"]) != ext._build_key("t", ["-O3"], [])
