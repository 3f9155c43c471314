"""freetoken/kernels/triton/moe_quant.py (the fused MoE decode path dequantizing FP8 / MXFP4 banks
in the kernel) against the float64 reference of the dequantized weights, under TRITON_INTERPRET=1 on
the CPU with tiny fp32 shapes; the same tests run on the GPU (`gpu` marked)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from freetoken.kernels.quant import quantize_bank
from freetoken.kernels.reference import expert_ffn_reference
from freetoken.kernels.triton.moe_grouped import tile
from freetoken.kernels.triton.moe_quant import fused_moe_quant_decode
from freetoken.kernels.triton.moe_quant_grouped import fused_moe_quant_grouped

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, S = 64, 64, 6
# small tiles: several programs per row range and several column steps per program
SMALL = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 16}, "down": {"BLOCK_N": 32, "BLOCK_K": 32}}


def _case(fmt: str, block: int, T: int = 2, K: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(S, 2 * I, H, generator=g) / H**0.5
    gu[:, :3, :16] *= 30.0  # one block with its own (large) scale
    dn = torch.randn(S, H, I, generator=g) / I**0.5
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, S, (T, K), generator=g)
    ids[0, 1] = -1  # an entry routed elsewhere
    return (x, ids, quantize_bank(gu, fmt, block, 2), quantize_bank(dn, fmt, block, 1))


def _run(fmt: str, block: int, zero_missing: bool):
    x, ids, gu, dn = _case(fmt, block)
    ref = expert_ffn_reference(x, ids, gu, dn)  # [T, K, H] float64, 0 where ids < 0
    y = torch.full((2, 2, H), float("nan"), device=DEVICE)
    fused_moe_quant_decode(x.to(DEVICE), ids.to(DEVICE), gu.to(DEVICE), dn.to(DEVICE), y,
                           SMALL, zero_missing=zero_missing)
    y = y.cpu()
    keep = ids >= 0
    assert torch.allclose(y[keep].double(), ref[keep], rtol=1e-5, atol=1e-5)
    if zero_missing:
        assert (y[~keep] == 0).all()
    else:
        assert torch.isnan(y[~keep]).all(), "entries with ids < 0 keep y's value"


@pytest.mark.parametrize("fmt,block", [("fp8", 16), ("fp8", 128), ("mxfp4", 32)])
@pytest.mark.parametrize("zero_missing", [False, True])
def test_quant_decode_matches_dequantized_reference(fmt, block, zero_missing):
    _run(fmt, block, zero_missing)


@pytest.mark.parametrize("fmt,block", [("fp8", 16), ("fp8", 128), ("mxfp4", 32)])
def test_quant_grouped_matches_dequantized_reference(fmt, block):
    # several tokens per expert (each expert's codes read once per row block of its entries),
    # small tiles so the K loops and the row blocks take several steps
    x, ids, gu, dn = _case(fmt, block, T=6, K=3, seed=2)
    ref = expert_ffn_reference(x, ids, gu, dn)
    y = torch.full((6, 3, H), float("nan"), device=DEVICE)
    cfg = (tile(16, 16, 16, 2, 4, 2), tile(16, 32, 16, 1, 4, 2))
    fused_moe_quant_grouped(x.to(DEVICE), ids.to(DEVICE), gu.to(DEVICE), dn.to(DEVICE), y, cfg)
    y = y.cpu()
    keep = ids >= 0
    assert torch.allclose(y[keep].double(), ref[keep], rtol=1e-5, atol=1e-5)
    assert torch.isnan(y[~keep]).all(), "entries with ids < 0 are not written"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block", [("fp8", 128), ("mxfp4", 32)])
def test_quant_decode_on_gpu(fmt, block):
    _run(fmt, block, True)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_run_experts_takes_the_quant_kernel(monkeypatch, fmt):
    # the expert FFN dispatch (experts/ffn.py) sends a decode-size quantized bank to this
    # kernel on the CUDA path (pointed at the interpreter here), and zeros entries with ids < 0
    from freetoken.experts import ffn
    from freetoken.kernels import dispatch
    from freetoken.kernels.triton import moe_quant

    monkeypatch.setattr(dispatch, "triton_for", lambda x, name: dispatch.triton_module(name))
    calls = []
    real = moe_quant.fused_moe_quant_decode
    monkeypatch.setattr(moe_quant, "fused_moe_quant_decode",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    x, ids, gu, dn = _case(fmt, 32, seed=1)
    y, ys = ffn.run_experts(x.to(DEVICE), ids.to(DEVICE), gu.to(DEVICE), dn.to(DEVICE))
    assert calls and ys is None
    ref = expert_ffn_reference(x, ids, gu, dn)
    assert torch.allclose(y.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    # past DECODE_MAX_ENTRIES: the grouped kernel, ids < 0 zeroed
    monkeypatch.setattr(moe_quant, "DECODE_MAX_ENTRIES", 2)
    y, _ = ffn.run_experts(x.to(DEVICE), ids.to(DEVICE), gu.to(DEVICE), dn.to(DEVICE))
    assert len(calls) == 1
    assert torch.allclose(y.cpu().double(), ref, rtol=1e-5, atol=1e-5)
