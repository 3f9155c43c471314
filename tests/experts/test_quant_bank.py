"""Quantized expert banks (freetoken/kernels/quant.py) through the host store, the slot cache and
the torch FFN paths: real byte counts, dequantization against a per-element decode written from
the format specs, and the slot contract (a slot holds its expert's exact bytes and scales)."""
from __future__ import annotations

import math

import pytest
import torch

from freetoken.experts.ffn import dispatch_experts, gathered_experts
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.store import ExpertStore
from freetoken.kernels.quant import QuantBank, quantize_bank
from freetoken.kernels.reference import expert_ffn_reference
from freetoken.types.model_config import ExpertFormat, expert_nbytes


def _banks(fmt: str, E=3, H=64, I=32, block=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    dn = torch.randn(E, H, I, generator=g) / I**0.5
    return (quantize_bank(gu, fmt, block, halves=2), quantize_bank(dn, fmt, block), gu, dn)


def _e4m3(b: int) -> float:
    """float8_e4m3fn byte -> value, from the format: 1 sign, 4 exponent (bias 7), 3 mantissa."""
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    v = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def _e2m1(c: int) -> float:
    """e2m1 code -> value: 1 sign, 2 exponent (bias 1), 1 mantissa."""
    s, e, m = c >> 3, (c >> 1) & 3, c & 1
    v = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if s else v


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_expert_nbytes_is_the_real_bytes(fmt):
    # the byte formula every floor and q* use, against the bytes the banks actually hold,
    # with I not a multiple of the fp8 block (gate and up each round their own row blocks)
    H, I, block = 96, (40 if fmt == "fp8" else 64), 32
    gu, dn, _, _ = _banks(fmt, E=2, H=H, I=I, block=block)
    want = (gu.nbytes + dn.nbytes) // 2
    assert expert_nbytes(H, I, ExpertFormat(fmt, block if fmt == "fp8" else 32)) == want
    store = ExpertStore([gu], [dn], pin=False)
    assert store.nbytes == gu.nbytes + dn.nbytes
    assert store.expert_bytes == want
    dense = expert_nbytes(H, I, torch.bfloat16)
    assert want < dense * (0.55 if fmt == "fp8" else 0.3)


def test_fp8_dequant_matches_per_element_decode():
    gu, _, w, _ = _banks("fp8", E=1, H=48, I=24, block=16)  # 2I=48: 2 row blocks per half
    half, B = 24, 16
    got = gu.dequantize(torch.float64)[0]
    raw = gu.data[0].view(torch.uint8)
    for r in range(0, 48, 5):
        srow = (r // half) * math.ceil(half / B) + (r % half) // B
        for c in range(0, 48, 7):
            want = _e4m3(int(raw[r, c])) * float(gu.scale[0, srow, c // B])
            assert float(got[r, c]) == pytest.approx(want, rel=1e-12, abs=0)
    # quantization as released checkpoints do it: each block's amax maps to 448
    assert (got - w[0].double()).abs().max() <= w.abs().max() * 2**-4


def test_mxfp4_dequant_matches_per_element_decode():
    _, dn, _, w = _banks("mxfp4", E=2, H=32, I=64)
    got = dn.dequantize(torch.float64)
    for e in range(2):
        for r in range(0, 32, 3):
            for c in range(64):
                byte = int(dn.data[e, r, c // 2])
                code = byte & 0xF if c % 2 == 0 else byte >> 4  # low nibble: even column
                want = _e2m1(code) * 2.0 ** (int(dn.scale[e, r, c // 32]) - 127)
                assert float(got[e, r, c]) == want
    # the shared exponent puts each group's amax within e2m1's range [4, 8)
    err = (got - w.double()).abs().reshape(2, 32, 2, 32).amax(-1)
    amax = w.double().abs().reshape(2, 32, 2, 32).amax(-1)
    assert (err <= amax / 4).all()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_slots_hold_the_store_bytes(fmt):
    gu, dn, _, _ = _banks(fmt, E=4)
    gu1, dn1, _, _ = _banks(fmt, E=4, seed=1)
    store = ExpertStore([gu, gu1], [dn, dn1], pin=False)
    cache = SlotCache(2, 4, 64, 32, 5, dtype=torch.float32, fmt=store.fmt)
    assert isinstance(cache.gate_up_slots, QuantBank)
    assert cache.slot_bytes() == store.expert_bytes
    for layer, ids in ((0, [[2, 0]]), (1, [[3, 1]]), (0, [[1, 2]])):
        d = cache.decide(layer, torch.tensor(ids), -1)
        cache.fill(layer, d.fetch_experts, d.fetch_slots, store)
        for e, s in zip(ids[0], d.slot_ids[0].tolist()):
            src_gu, src_dn = store.gate_up(layer)[e], store.down(layer)[e]
            assert torch.equal(cache.gate_up_slots.data[s].view(torch.uint8),
                               src_gu.data.view(torch.uint8))
            assert torch.equal(cache.gate_up_slots.scale[s], src_gu.scale)
            assert torch.equal(cache.down_slots.data[s].view(torch.uint8),
                               src_dn.data.view(torch.uint8))
            assert torch.equal(cache.down_slots.scale[s], src_dn.scale)
    cache.resize(2)  # survivors move with their bytes and scales
    owners = cache.table.slot_owner.tolist()
    assert sorted(o for o in owners if o >= 0) == [1, 2]  # layer 0's experts 1, 2: the newest
    for s, o in enumerate(owners):
        layer, e = divmod(o, 4)
        assert torch.equal(cache.down_slots.scale[s], store.down(layer)[e].scale)
        assert torch.equal(cache.gate_up_slots.data[s].view(torch.uint8),
                           store.gate_up(layer)[e].data.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_torch_paths_read_quantized_banks(fmt):
    # the grouped path (several tokens) and the gathered path against the float64 reference
    # of the dequantized weights
    gu, dn, _, _ = _banks(fmt, E=4)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g)
    ids = torch.randint(0, 4, (5, 2), generator=g)
    ids[1, 0] = -1
    ref = expert_ffn_reference(x, ids, gu, dn)
    y = dispatch_experts(x, ids, gu, dn, torch.zeros(5, 2, 64))
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6)
    y2 = gathered_experts(x, ids, gu, dn, torch.zeros(5, 2, 64))
    assert torch.allclose(y2.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantize_stays_on_the_banks_device(fmt):
    """Quantizing makes nothing on the CPU beside banks on another device (the H200's clamp
    test quantized CUDA banks and met a CPU code grid, session 19): on the meta device every
    output stays there and the shapes are those of a CPU quantization."""
    w = torch.randn(2, 256, 256)
    block = 32 if fmt == "mxfp4" else 128
    want = quantize_bank(w, fmt, block, 2)
    got = quantize_bank(w.to("meta"), fmt, block, 2)
    assert got.data.device.type == "meta" and got.scale.device.type == "meta"
    assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
    assert got.data.dtype == want.data.dtype and got.scale.dtype == want.scale.dtype
