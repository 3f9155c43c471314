"""Decode attention read in place from the paged pool, against a float64 reference."""
from __future__ import annotations

import pytest
import torch

import freetoken.kernels.cpu.attention_ops as ao
from freetoken.kernels.cpu.ext import build, detect_isa


def _ref(q, k_pool, v_pool, slots, scale):
    k = k_pool[slots].double()  # [L, Hk, D]
    v = v_pool[slots].double()
    rep = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [L, Hq, D]
    s = torch.einsum("hd,lhd->hl", q.double(), k) * scale  # [Hq, L]
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v)  # [Hq, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [1, 7, 100, 3000])
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (8, 8, 32), (6, 1, 16)])
def test_matches_float64_reference(monkeypatch, dtype, L, threads, hq, hk, d) -> None:
    build(detect_isa())
    monkeypatch.setattr(ao, "MIN_KEYS", 0)
    g = torch.Generator().manual_seed(L + threads + d)
    S = 4 * L + 11
    k_pool = torch.randn(S, hk, d, generator=g).to(dtype)
    v_pool = torch.randn(S, hk, d, generator=g).to(dtype)
    slots = torch.randperm(S, generator=g)[:L]  # scattered pool rows, any order
    q = torch.randn(hq, d, generator=g) * 3  # peaked softmax: exercises the running max
    got = ao.cpu_decode_attention(q, k_pool, v_pool, slots, d**-0.5, num_threads=threads)
    assert got is not None and got.shape == (hq, d) and got.dtype == torch.float32
    ref = _ref(q, k_pool, v_pool, slots, d**-0.5)
    assert float((got.double() - ref).abs().max()) < 1e-5 * max(1.0, float(ref.abs().max()))


def test_declines_what_it_does_not_take(monkeypatch) -> None:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(900, 2, 64, generator=g)
    q = torch.randn(4, 64, generator=g)
    slots = torch.arange(600)
    assert ao.cpu_decode_attention(q, k, k, slots[:10], 0.125) is None  # below MIN_KEYS
    assert ao.cpu_decode_attention(q, k, k.to(torch.bfloat16), slots, 0.125) is None
    assert ao.cpu_decode_attention(q, k.transpose(0, 1).contiguous().transpose(0, 1), k, slots,
                                   0.125) is None  # a non-contiguous pool
    monkeypatch.setenv("FT_CPU_ISA", "torch")
    assert ao.cpu_decode_attention(q, k, k, slots, 0.125) is None  # no kernel
