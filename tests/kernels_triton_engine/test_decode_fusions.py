"""The engine's small Triton kernels against float64 torch references: the MoE combine
(weighted expert sum + gated shared expert + residual) and the device-driven
expert fill. Interpreted on the CPU (tiny fp32 shapes), compiled on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.triton.decode_fusions import moe_combine
from kernels.triton.uva_fill import fill_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shared", [False, True])
def test_moe_combine(shared: bool) -> None:
    g0 = torch.Generator().manual_seed(7)
    T, K, H = 3, 4, 96
    y, w = torch.randn(T, K, H, generator=g0), torch.rand(T, K, generator=g0)
    res = torch.randn(T, H, generator=g0)
    sh = torch.randn(T, H, generator=g0) if shared else None
    sg = torch.randn(T, 1, generator=g0) if shared else None
    out = moe_combine(y.to(DEV), w.to(DEV), res.to(DEV), None if sh is None else sh.to(DEV),
                      None if sg is None else sg.to(DEV)).cpu()
    want = res.double() + (y.double() * w.double()[..., None]).sum(1)
    if shared:
        want = want + torch.sigmoid(sg.double()) * sh.double()
    assert rel(out, want) < 1e-6


def test_fill_rows_copies_only_valid_entries() -> None:
    g0 = torch.Generator().manual_seed(1)
    src = torch.randn(6, 8, 24, generator=g0)  # E experts of [8, 24]
    if DEV == "cuda":
        src = src.pin_memory()
    dst = torch.full((5, 8, 24), float("nan"), device=DEV)
    experts = torch.tensor([4, 0, -1, -1], device=DEV)
    slots = torch.tensor([1, 3, -1, -1], device=DEV)
    fill_rows(src, dst, experts, slots, block=64, iters=2)
    d = dst.cpu()
    assert torch.equal(d[1], src[4]) and torch.equal(d[3], src[0])
    for s in (0, 2, 4):
        assert torch.isnan(d[s]).all()  # untouched
