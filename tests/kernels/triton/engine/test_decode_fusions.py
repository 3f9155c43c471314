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

from freetoken.kernels.triton.decode_fusions import moe_combine, sigmoid_gate_mul
from freetoken.kernels.triton.uva_fill import fill_pair, fill_rows

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


def test_fill_pair_copies_both_banks_in_one_launch() -> None:
    """Two banks of different row sizes (gate_up [2I, H] and down [H, I] rows), several chunks
    each: every chunk of each valid entry lands in its slot of its own bank, padding and other
    slots untouched. Bugs caught: bank b's chunks offset from bank a's count wrongly (a row
    copied in part, or shifted), a bank's rows read with the other's size."""
    g0 = torch.Generator().manual_seed(2)
    src_a = torch.randn(6, 8, 40, generator=g0)  # 320 elements: 3 chunks of 128
    src_b = torch.randn(6, 20, 8, generator=g0)  # 160 elements: 2 chunks
    if DEV == "cuda":
        src_a, src_b = src_a.pin_memory(), src_b.pin_memory()
    dst_a = torch.full((5, 8, 40), float("nan"), device=DEV)
    dst_b = torch.full((5, 20, 8), float("nan"), device=DEV)
    experts = torch.tensor([4, -1, 0, 5], device=DEV)
    slots = torch.tensor([1, -1, 3, -1], device=DEV)  # the last: no slot, not copied
    fill_pair(src_a, dst_a, src_b, dst_b, experts, slots, block=64, iters=2)
    a, b = dst_a.cpu(), dst_b.cpu()
    assert torch.equal(a[1], src_a[4]) and torch.equal(a[3], src_a[0])
    assert torch.equal(b[1], src_b[4]) and torch.equal(b[3], src_b[0])
    for s in (0, 2, 4):
        assert torch.isnan(a[s]).all() and torch.isnan(b[s]).all()


@pytest.mark.parametrize("H", [96, 2100])
def test_moe_combine_computes_the_shared_gate(H: int) -> None:
    """The gate Linear(H, 1) computed inside the combine (H=2100: the dot spans three 1024
    blocks, the last one masked) against float64; bug it catches: a dot over one block only,
    or the gate read from the wrong row."""
    g0 = torch.Generator().manual_seed(11)
    T, K = 3, 2
    y, w = torch.randn(T, K, H, generator=g0), torch.rand(T, K, generator=g0)
    res, sh = torch.randn(T, H, generator=g0), torch.randn(T, H, generator=g0)
    x, gw = torch.randn(T, H, generator=g0), torch.randn(1, H, generator=g0) / H**0.5
    out = moe_combine(y.to(DEV), w.to(DEV), res.to(DEV), sh.to(DEV), gate_x=x.to(DEV),
                      gate_weight=gw.to(DEV)).cpu()
    gate = x.double() @ gw.double().T  # [T, 1]
    want = (res.double() + (y.double() * w.double()[..., None]).sum(1)
            + torch.sigmoid(gate) * sh.double())
    assert rel(out, want) < 1e-6
    per_row = (out.double() - want).norm(dim=-1) / want.norm(dim=-1)
    assert per_row.max() < 1e-6


def test_moe_combine_gate_rounds_like_the_linear() -> None:
    """16-bit: the computed gate is rounded to x's dtype before the sigmoid, as the Linear's
    output is; the result equals the combine given that rounded gate (the previous two-step
    path). fp16 here: the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest), so a
    bf16 check would compare rounding modes; test_decode_fusions_gpu.py checks bf16."""
    g0 = torch.Generator().manual_seed(12)
    T, K, H = 4, 3, 64
    dt = torch.float16
    y = torch.randn(T, K, H, generator=g0).to(dt)
    w = torch.rand(T, K, generator=g0).to(dt)
    res, sh = torch.randn(T, H, generator=g0).to(dt), torch.randn(T, H, generator=g0).to(dt)
    x, gw = torch.randn(T, H, generator=g0).to(dt), torch.randn(1, H, generator=g0).to(dt)
    gate = (x.double() @ gw.double().T).to(dt)  # [T, 1] the Linear's rounded output
    a = moe_combine(y.to(DEV), w.to(DEV), res.to(DEV), sh.to(DEV), gate_x=x.to(DEV),
                    gate_weight=gw.to(DEV))
    b = moe_combine(y.to(DEV), w.to(DEV), res.to(DEV), sh.to(DEV), shared_gate=gate.to(DEV))
    assert torch.equal(a.cpu(), b.cpu())


def test_sigmoid_gate_mul_reads_the_gate_view() -> None:
    """o * sigmoid(gate) with the gate the second half of each head of a [T, Hq, 2D]
    projection (the gated attention's layout), flattened to [T, Hq*D]."""
    g0 = torch.Generator().manual_seed(13)
    T, NH, D = 3, 4, 24
    qg = torch.randn(T, NH, 2 * D, generator=g0)
    o = torch.randn(T, NH, D, generator=g0)
    out = sigmoid_gate_mul(o.to(DEV), qg.to(DEV)[..., D:]).cpu()
    want = (o.double() * torch.sigmoid(qg[..., D:].double())).reshape(T, NH * D)
    assert out.shape == (T, NH * D)
    assert rel(out, want) < 1e-6


@pytest.mark.parametrize("zero_centered,H", [(True, 96), (False, 96), (True, 2100)])
def test_moe_combine_with_next_norm(zero_centered: bool, H: int) -> None:
    """The next layer's input RMSNorm from the combine's launch: out as without it, and the
    norm of out equal to the RMSNorm module on it (one program per row; H=2100 a masked tail).
    Bug it catches: a norm over one block of the row, or of the unrounded sum."""
    from freetoken.layers.norm import RMSNorm

    g0 = torch.Generator().manual_seed(14)
    T, K = 3, 2
    y, w = torch.randn(T, K, H, generator=g0), torch.rand(T, K, generator=g0)
    res, sh = torch.randn(T, H, generator=g0), torch.randn(T, H, generator=g0)
    x, gw = torch.randn(T, H, generator=g0), torch.randn(1, H, generator=g0) / H**0.5
    norm = RMSNorm(H, 1e-6, zero_centered)
    norm.weight.data = torch.randn(H, generator=g0) * 0.3 + (0 if zero_centered else 1)
    args = (y.to(DEV), w.to(DEV), res.to(DEV), sh.to(DEV))
    kw = {"gate_x": x.to(DEV), "gate_weight": gw.to(DEV)}
    out, normed = moe_combine(*args, **kw, norm=(norm.weight.data.to(DEV), 1e-6, zero_centered))
    plain = moe_combine(*args, **kw)
    if DEV == "cuda":  # two compiled specializations may round the last bit apart
        assert rel(out.cpu(), plain.cpu()) < 1e-6
    else:
        assert torch.equal(out.cpu(), plain.cpu())
    with torch.no_grad():
        want = norm(out.cpu())
    assert normed.dtype == want.dtype
    assert rel(normed.cpu(), want) < 1e-6
