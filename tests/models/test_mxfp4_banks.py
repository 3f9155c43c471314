"""gpt-oss MXFP4 expert tensors -> runtime banks (freetoken/checkpoint/mxfp4.py) against
transformers' own dequantization (`integrations.mxfp4.convert_moe_packed_tensors`, what
transformers runs when it loads gpt-oss without MXFP4 kernels): same weights, regrouped from
gpt-oss's interleaved gate/up rows to the bank's [gate | up]; and the CPU expert kernel over
the bank equals the float64 reference of transformers' dequantized weights."""
from __future__ import annotations

import pytest
import torch

from freetoken.checkpoint.mxfp4 import mxfp4_bank
from freetoken.kernels.cpu.expert_ops import cpu_experts
from freetoken.kernels.reference import expert_ffn_reference

mx = pytest.importorskip("transformers.integrations.mxfp4")

E, H, I = 3, 64, 32


def _packed(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_banks_equal_transformers_dequantization():
    gb, gs = _packed(2 * I, H, 0)
    db, ds = _packed(H, I, 1)
    gu, dn = mxfp4_bank(gb, gs, interleaved_gate_up=True), mxfp4_bank(db, ds)
    # transformers: [E, 2I, H] dequantized then transposed to its compute layout [E, H, 2I]
    hf_gu = mx.convert_moe_packed_tensors(gb, gs, dtype=torch.float32)  # [E, H, 2I]
    hf_dn = mx.convert_moe_packed_tensors(db, ds, dtype=torch.float32)  # [E, I, H]
    want_gu = torch.cat((hf_gu[..., 0::2], hf_gu[..., 1::2]), dim=-1).transpose(1, 2)
    assert torch.equal(gu.dequantize(torch.float32), want_gu)  # [E, 2I, H] rows [gate | up]
    assert torch.equal(dn.dequantize(torch.float32), hf_dn.transpose(1, 2))  # [E, H, I]
    # the CPU kernel reads the regrouped bank as stored
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 2], [1, 1]])
    ref = expert_ffn_reference(x, ids, want_gu, hf_dn.transpose(1, 2))
    got = cpu_experts(x, ids, gu, dn)
    assert float((got.double() - ref).norm() / ref.norm()) < 2e-6


def test_bad_shapes_are_refused():
    gb, gs = _packed(2 * I, H, 0)
    with pytest.raises(ValueError, match="expected"):
        mxfp4_bank(gb, gs[:, :, :1])
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_bank(gb.to(torch.int32), gs)
