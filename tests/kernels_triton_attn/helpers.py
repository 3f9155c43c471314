"""Shared bits of the Triton kernel tests: the device and a relative-error measure."""
from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over max |ref|: one number per tensor, independent of its scale."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite output (a poisoned row was not written?)"
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
