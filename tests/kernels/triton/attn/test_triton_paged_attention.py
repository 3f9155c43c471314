"""Paged decode (split-K) and prefill attention against a float64 reference over the same pool.

Every pool row no sequence owns holds NaN, and the spare tail of kv_indices points at such rows,
so a kernel that reads a slot it should not (past a sequence's end, past kv_indptr[B], another
KV head) returns NaN and fails; outputs start as NaN so an unwritten row fails too.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from freetoken.kernels.triton.paged_attention import paged_decode_attention, paged_prefill_attention
from tests.kernels.triton.attn.helpers import DEVICE, rel_err


def _pool_and_csr(lengths: list[int], hk: int, d: int, gen: torch.Generator,
                  index_dtype: torch.dtype = torch.int32, spare: int = 6):
    """k/v pools [S, Hk, D] with NaN in unowned rows; CSR over scattered slots, with `spare`
    extra kv_indices entries (a preallocated buffer) pointing at NaN rows."""
    total = sum(lengths)
    S = 2 * total + spare + 3
    perm = torch.randperm(S, generator=gen)
    used, free = perm[:total], perm[total:]
    k_pool = torch.full((S, hk, d), float("nan"))
    v_pool = torch.full((S, hk, d), float("nan"))
    k_pool[used] = torch.randn(total, hk, d, generator=gen)
    v_pool[used] = torch.randn(total, hk, d, generator=gen)
    indptr = torch.tensor([0] + lengths).cumsum(0)
    indices = torch.cat([used, free[:spare]])
    return k_pool, v_pool, indptr.to(index_dtype), indices.to(index_dtype)


def _reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, first_limit: int,
               scale: float) -> torch.Tensor:
    """q [n, Hq, D]; keys/vals [L, Hk, D]; query i sees keys 0..first_limit+i. float64."""
    n, hq, _ = q.shape
    rep = hq // keys.shape[1]
    k = keys.double().repeat_interleave(rep, dim=1)  # [L, Hq, D]
    v = vals.double().repeat_interleave(rep, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale  # [Hq, n, L]
    L = keys.shape[0]
    allowed = torch.arange(L)[None, :] <= first_limit + torch.arange(n)[:, None]  # [n, L]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)  # [n, Hq, D]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("hq,hk,index_dtype", [(4, 2, torch.int32), (8, 2, torch.int64),
                                               (2, 2, torch.int32)])
def test_decode_matches_float64(num_splits: int, hq: int, hk: int, index_dtype) -> None:
    """Sequences of length 1, 37, 7 and 32 in one launch; 8 splits leave the short ones with
    empty splits (lse = -inf in the merge); 37 keys cross several 16-key tiles per split, 32
    fills two tiles exactly."""
    gen = torch.Generator().manual_seed(num_splits * 10 + hq)
    d, lengths = 16, [1, 37, 7, 32]
    k_pool, v_pool, indptr, indices = _pool_and_csr(lengths, hk, d, gen, index_dtype)
    q = torch.randn(len(lengths), hq, d, generator=gen) * 3  # peaked softmax
    out = torch.full((len(lengths), hq, d), float("nan"), device=DEVICE)
    scale = d ** -0.5
    got = paged_decode_attention(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                                 indptr.to(DEVICE), indices.to(DEVICE), scale, out=out,
                                 num_splits=num_splits)
    assert got is out
    for b, L in enumerate(lengths):
        slots = indices[indptr[b]:indptr[b + 1]].long()
        ref = _reference(q[b:b + 1], k_pool[slots], v_pool[slots], L - 1, scale)[0]
        assert rel_err(got[b], ref) <= 1e-4, f"sequence {b} (L={L})"


def test_decode_default_splits_and_allocated_output() -> None:
    gen = torch.Generator().manual_seed(7)
    k_pool, v_pool, indptr, indices = _pool_and_csr([19, 2], 2, 16, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    got = paged_decode_attention(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                                 indptr.to(DEVICE), indices.to(DEVICE), 0.25)
    assert got.shape == (2, 4, 16) and got.dtype == torch.float32
    for b in range(2):
        slots = indices[indptr[b]:indptr[b + 1]].long()
        ref = _reference(q[b:b + 1], k_pool[slots], v_pool[slots], len(slots) - 1, 0.25)[0]
        assert rel_err(got[b], ref) <= 1e-4


@pytest.mark.parametrize("hq,hk", [(4, 2), (2, 1)])
def test_prefill_causal_matches_float64(hq: int, hk: int) -> None:
    """(new tokens, kv length): a fresh prompt, a chunk after a 9-token prefix, a single token
    after a prefix, 20 new tokens over 33 keys (two 16-row query blocks under the
    interpreter) and exactly one full block. Query i of sequence b sees keys 0..L_b - n_b + i."""
    gen = torch.Generator().manual_seed(hq)
    d = 16
    news, lengths = [5, 3, 1, 20, 16], [5, 12, 6, 33, 16]
    k_pool, v_pool, kv_indptr, indices = _pool_and_csr(lengths, hk, d, gen)
    qo_indptr = torch.tensor([0] + news).cumsum(0).to(torch.int32)
    T = sum(news)
    q = torch.randn(T, hq, d, generator=gen) * 2
    scale = d ** -0.5
    got = paged_prefill_attention(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                                  qo_indptr.to(DEVICE), kv_indptr.to(DEVICE), indices.to(DEVICE),
                                  scale)
    assert got.shape == (T, hq, d)
    for b, (n, L) in enumerate(zip(news, lengths)):
        slots = indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ref = _reference(q[lo:hi], k_pool[slots], v_pool[slots], L - n, scale)
        assert rel_err(got[lo:hi], ref) <= 1e-4, f"sequence {b} (n={n}, L={L})"


def test_prefill_of_one_token_equals_decode() -> None:
    """A batch of one-token rows through prefill gives decode's answer (same pool, same CSR)."""
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 17]
    k_pool, v_pool, kv_indptr, indices = _pool_and_csr(lengths, 2, 16, gen)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    args = (k_pool.to(DEVICE), v_pool.to(DEVICE))
    qo = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    pre = paged_prefill_attention(q, *args, qo, kv_indptr.to(DEVICE), indices.to(DEVICE), 0.3)
    dec = paged_decode_attention(q, *args, kv_indptr.to(DEVICE), indices.to(DEVICE), 0.3,
                                 num_splits=2)
    assert rel_err(pre, dec) <= 1e-5


def test_rejects_bad_shapes() -> None:
    k = torch.zeros(4, 3, 16)
    with pytest.raises(ValueError, match="GQA"):
        paged_decode_attention(torch.zeros(1, 4, 16), k, k, torch.tensor([0, 1]),
                               torch.tensor([0]), 1.0)
    k = torch.zeros(4, 2, 24)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(torch.zeros(1, 4, 24), k, k, torch.tensor([0, 1]),
                               torch.tensor([0]), 1.0)
