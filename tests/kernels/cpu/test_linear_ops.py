"""The decode-size linear kernel against a float64 reference, and its torch fallbacks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import freetoken.kernels.cpu.linear_ops as lo
from freetoken.kernels.cpu.ext import build, detect_isa


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    monkeypatch.setattr(lo, "MIN_WEIGHT_BYTES", 0)  # tiny test weights take the kernel path


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_matches_float64_reference(wdtype: torch.dtype, rows: int, threads: int,
                                   monkeypatch) -> None:
    build(detect_isa())
    monkeypatch.setattr(lo, "MAX_ROWS", {torch.float32: 16, torch.bfloat16: 16})
    called = []
    real = lo.F.linear
    monkeypatch.setattr(lo.F, "linear", lambda *a: called.append(1) or real(*a))
    g = torch.Generator().manual_seed(rows * 10 + threads)
    k, n = 67, 1000 + rows  # vector tails; units of 32 rows with a partial last one
    x = torch.randn(rows, k, generator=g)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(wdtype)
    got = lo.small_linear(x, w, num_threads=threads)
    ref = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert not called, "the kernel path must have run"
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6


def test_keeps_leading_dims_and_dtype() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 40, generator=g).to(torch.bfloat16)
    w = torch.randn(300, 40, generator=g).to(torch.bfloat16)
    got = lo.small_linear(x, w)
    assert got.shape == (1, 2, 300) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def test_torch_fallbacks(monkeypatch) -> None:
    """Too many rows, a small weight, a non-contiguous weight and a kernel-less build all give
    torch's result exactly."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 48, generator=g)
    for x, weight in ((torch.randn(lo.MAX_ROWS[torch.float32] + 1, 48, generator=g), w),
                      (torch.randn(3, 48, generator=g).to(torch.bfloat16), w.to(torch.bfloat16)),
                      (torch.randn(2, 48, generator=g), w.T.contiguous().T)):
        assert torch.equal(lo.small_linear(x, weight), F.linear(x, weight))
    monkeypatch.setattr(lo, "MIN_WEIGHT_BYTES", 1 << 30)
    x = torch.randn(1, 48, generator=g)
    assert torch.equal(lo.small_linear(x, w), F.linear(x, w))
    monkeypatch.setattr(lo, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setenv("FT_CPU_ISA", "torch")
    assert torch.equal(lo.small_linear(x, w), F.linear(x, w))
