"""Sink + sliding-window paged decode (freetoken/kernels/triton/sink_attention.py) against a float64
reference over the same pool, and against the engine's torch path (layers/sink_attention.
attend_sinks, what gpt-oss runs without the kernel).

Pool rows no row owns hold NaN and the spare tail of kv_indices points at such rows
(`_pool_and_csr` of the paged-attention test), so a kernel that reads a slot it should not
returns NaN; outputs start as NaN so an unwritten row fails too. Windows shorter and longer than
the rows, sinks large enough to take most of a head's mass (and a very negative one that takes
none), and split counts that leave splits empty."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from freetoken.kernels.triton.sink_attention import sink_decode_attention
from freetoken.layers.sink_attention import attend_sinks
from tests.kernels.triton.attn.helpers import DEVICE, rel_err
from tests.kernels.triton.attn.test_triton_paged_attention import _pool_and_csr


def _reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, sinks: torch.Tensor,
               scale: float, window: int) -> torch.Tensor:
    """One query q [Hq, D] at the last position of keys/vals [L, Hk, D]; float64, written
    out as the formula: o = Σ exp(s_j) v_j / (Σ exp(s_j) + exp(sink))."""
    L = keys.shape[0]
    lo = max(0, L - window) if window else 0
    rep = q.shape[0] // keys.shape[1]
    k = keys[lo:].double().repeat_interleave(rep, dim=1)  # [L', Hq, D]
    v = vals[lo:].double().repeat_interleave(rep, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), k) * scale  # [Hq, L']
    top = torch.maximum(s.amax(-1), sinks.double())  # [Hq]
    e = (s - top[:, None]).exp()
    den = e.sum(-1) + (sinks.double() - top).exp()
    return torch.einsum("hl,lhd->hd", e, v) / den[:, None]  # [Hq, D]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("window", [0, 5, 16])
@pytest.mark.parametrize("hq,hk,index_dtype", [(4, 2, torch.int32), (8, 2, torch.int64)])
def test_decode_matches_float64(num_splits: int, window: int, hq: int, hk: int,
                                index_dtype) -> None:
    """Rows of 1, 37, 7, 32 and 5 keys in one launch: windows 5 and 16 cut the long ones
    (37 keys, window 16: one full tile plus a partial one after the cut), not the short ones."""
    gen = torch.Generator().manual_seed(num_splits * 100 + window * 10 + hq)
    d, lengths = 16, [1, 37, 7, 32, 5]
    k_pool, v_pool, indptr, indices = _pool_and_csr(lengths, hk, d, gen, index_dtype)
    q = torch.randn(len(lengths), hq, d, generator=gen) * 2
    sinks = torch.randn(hq, generator=gen) * 2
    sinks[0] = 6.0  # most of head 0's mass goes to the sink
    sinks[-1] = -40.0  # none of the last head's: plain softmax
    out = torch.full((len(lengths), hq, d), float("nan"), device=DEVICE)
    got = sink_decode_attention(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                                indptr.to(DEVICE), indices.to(DEVICE), d ** -0.5,
                                sinks.to(DEVICE), window, out=out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()
    offs = indptr.tolist()
    for b in range(len(lengths)):
        slots = indices[offs[b]:offs[b + 1]].long()
        want = _reference(q[b], k_pool[slots], v_pool[slots], sinks, d ** -0.5, window)
        assert rel_err(got[b], want) < 1e-5, (b, lengths[b])
        # the engine's torch path on the same keys (the decode query is the last position)
        L = slots.numel()
        torch_path = attend_sinks(q[b:b + 1], k_pool[slots], v_pool[slots], L - 1, d ** -0.5,
                                  sinks, window)[0]
        assert rel_err(got[b], torch_path) < 1e-5, (b, lengths[b])


def test_sink_lowers_the_mass() -> None:
    """The sink is in the denominator only: with one key, o = v * σ(s - sink) exactly."""
    gen = torch.Generator().manual_seed(1)
    d, hq, hk = 16, 2, 1
    k_pool, v_pool, indptr, indices = _pool_and_csr([1], hk, d, gen)
    q = torch.randn(1, hq, d, generator=gen)
    sinks = torch.tensor([0.5, -1.0])
    got = sink_decode_attention(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                                indptr.to(DEVICE), indices.to(DEVICE), 0.25, sinks.to(DEVICE),
                                num_splits=2)
    slot = int(indices[0])
    s = (q[0].double() @ k_pool[slot, 0].double()) * 0.25  # [Hq]
    want = torch.sigmoid(s - sinks.double())[:, None] * v_pool[slot, 0].double()[None, :]
    assert rel_err(got[0], want) < 1e-6


def test_bf16_pool_close_to_float64() -> None:
    """A bf16 pool and query (the served dtype): fp32 accumulation keeps it near the float64
    result of the same bf16 inputs."""
    gen = torch.Generator().manual_seed(2)
    d, hq, hk, lengths = 32, 4, 2, [40, 3]
    k_pool, v_pool, indptr, indices = _pool_and_csr(lengths, hk, d, gen)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    q = torch.randn(len(lengths), hq, d, generator=gen).bfloat16()
    sinks = torch.randn(hq, generator=gen).bfloat16()
    got = sink_decode_attention(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                                indptr.to(DEVICE), indices.to(DEVICE), d ** -0.5,
                                sinks.to(DEVICE), 8, num_splits=2)
    assert got.dtype == torch.bfloat16
    offs = indptr.tolist()
    for b in range(len(lengths)):
        slots = indices[offs[b]:offs[b + 1]].long()
        want = _reference(q[b], k_pool[slots], v_pool[slots], sinks, d ** -0.5, 8)
        assert rel_err(got[b], want) < 2e-2


def test_refusals() -> None:
    k = torch.zeros(4, 2, 16)
    ip, ix = torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="sinks"):
        sink_decode_attention(torch.zeros(1, 4, 16), k, k, ip, ix, 1.0, torch.zeros(3))
    with pytest.raises(ValueError, match="window"):
        sink_decode_attention(torch.zeros(1, 4, 16), k, k, ip, ix, 1.0, torch.zeros(4), -1)
