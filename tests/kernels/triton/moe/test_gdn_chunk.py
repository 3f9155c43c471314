"""The chunked gated-delta scan kernel (freetoken/kernels/triton/gdn_chunk.py) against a float64
loop of the recurrence it replaces (freetoken/layers/gated_delta.py), under the interpreter on
CPU."""
from __future__ import annotations

import pytest
import torch

from freetoken.kernels.triton.gdn_chunk import chunk_scan, supported


def _reference(u, w, qd, kd, a, dec, s):
    u, w, qd, kd, a, dec, s = (t.double() for t in (u, w, qd, kd, a, dec, s))
    out = torch.empty_like(u)
    for i in range(u.shape[1]):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = qd[:, i] @ s + a[:, i] @ v_new
        s = s * dec[:, i, None, None] + kd[:, i].transpose(-1, -2) @ v_new
    return out, s


@pytest.mark.parametrize("H,N,C,K,V", [(2, 3, 16, 16, 64), (1, 2, 32, 16, 16)])
def test_chunk_scan_matches_float64_loop(H, N, C, K, V) -> None:
    g = torch.Generator().manual_seed(0)
    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale
    u, w = r(H, N, C, V), r(H, N, C, K)
    qd, kd = r(H, N, C, K), r(H, N, C, K)
    a = r(H, N, C, C).tril()
    dec = torch.rand(H, N, generator=g) * 0.5 + 0.5
    s0 = r(H, K, V)
    before = s0.clone()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # u as a transposed view (what solve_triangular returns on CUDA): the kernel must not
    # assume its inputs' or its output's layout
    u_t = u.transpose(-1, -2).contiguous().transpose(-1, -2)
    out, s = chunk_scan(*(t.to(dev) for t in (u_t, w, qd, kd, a, dec, s0)))
    out, s = out.cpu(), s.cpu()
    want_out, want_s = _reference(u, w, qd, kd, a, dec, s0)
    assert (out.double() - want_out).abs().max() < 1e-4
    assert (s.double() - want_s).abs().max() < 1e-4
    assert torch.equal(s0, before)  # the caller's state is not written


def test_supported_shapes() -> None:
    assert supported(64, 128, 128) and not supported(64, 96, 128) and not supported(8, 16, 16)
