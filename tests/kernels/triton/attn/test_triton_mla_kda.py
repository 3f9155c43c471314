"""The absorbed-MLA decode kernel (freetoken/kernels/triton/mla_decode.py) against a float64
softmax over the gathered latents, and the KDA decode kernel (freetoken/kernels/triton/kda.py)
against the torch recurrence (`recurrent_kda`), on tiny fp32 shapes under the Triton interpreter:
latent and head dims that are not powers of two (masked tiles), a partial head block, scattered
slots, rows of one key, several splits; the state pool updated in place at its slots only."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from freetoken.kernels.triton.kda import kda_recurrent_pool
from freetoken.kernels.triton.mla_decode import mla_decode_attention


def _mla_reference(q_lat, pool, rows, scale, c):
    out = []
    for b, slots in enumerate(rows):
        lat = pool[slots, 0].double()  # [L, C+R]
        p = torch.softmax(q_lat[b].double() @ lat.T * scale, -1)  # [Hq, L]
        out.append(p @ lat[:, :c])
    return torch.stack(out)  # [B, Hq, C]


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_matches_float64(splits: int) -> None:
    g = torch.Generator().manual_seed(0)
    B, hq, c, r, S = 3, 20, 48, 16, 200
    pool = torch.randn(S, 1, c + r, generator=g)
    q = torch.randn(B, hq, c + r, generator=g)
    perm = torch.randperm(S, generator=g)
    lens = [1, 37, 70]
    rows, at = [], 0
    for n in lens:
        rows.append(perm[at:at + n])
        at += n
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([*rows, torch.zeros(5, dtype=torch.int64)]).to(torch.int32)  # spare
    scale = (c + r) ** -0.5 * 1.3
    got = mla_decode_attention(q, pool, indptr, indices, scale, c, num_splits=splits)
    want = _mla_reference(q, pool, rows, scale, c)
    assert got.shape == (B, hq, c)
    assert (got.double() - want).abs().max() < 1e-5


def test_mla_decode_refuses_mismatched_shapes() -> None:
    q, pool = torch.zeros(1, 4, 64), torch.zeros(8, 1, 60)
    idx = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="MLA latents"):
        mla_decode_attention(q, pool, idx, idx, 1.0, 48)


def test_kda_step_matches_torch_in_place() -> None:
    from freetoken.layers.kda_rule import recurrent_kda

    g = torch.Generator().manual_seed(1)
    B, H, K, V, S = 2, 3, 16, 24, 5
    l2 = lambda x: x / x.norm(dim=-1, keepdim=True)
    q, k = l2(torch.randn(B, H, K, generator=g)), l2(torch.randn(B, H, K, generator=g))
    v = torch.randn(B, H, V, generator=g)
    gate = -torch.rand(B, H, K, generator=g) * 2  # log decay per channel
    beta = torch.rand(B, H, generator=g)
    pool = torch.randn(S, H, K, V, generator=g)
    slots = torch.tensor([3, 1])
    before = pool.clone()
    want_o, want_s = recurrent_kda(q, k, v, gate, beta, pool[slots])
    o = kda_recurrent_pool(q, k, v, gate, beta, pool, slots)
    assert (o - want_o).abs().max() < 1e-5
    assert (pool[slots] - want_s).abs().max() < 1e-5
    untouched = [i for i in range(S) if i not in (1, 3)]
    assert torch.equal(pool[untouched], before[untouched])
