"""freetoken/kernels/triton/router.py against freetoken.layers.moe.Router.forward (torch's softmax
+ topk).

Under TRITON_INTERPRET=1 on the CPU. Two oracles: the Router itself (same weights to rounding,
same set of ids), and a stable sort of the Router's logits by (-logit, id), which fixes the
order of exact ties (frequent with bf16 logits) the way the kernel documents: lowest id first.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from freetoken.kernels.triton.router import fused_router, router_topk
from freetoken.layers.moe import Router

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_router(x, weight, top_k, renormalize):
    """Router.forward on the CPU, where it takes its torch path (on CUDA it calls the kernel)."""
    assert x.device.type == "cpu"
    r = Router(weight.shape[1], weight.shape[0], top_k, renormalize).to(x.dtype)
    with torch.no_grad():
        r.weight.copy_(weight)
        return r(x)


@pytest.mark.parametrize("T,E,K,renorm,dtype", [
    (1, 8, 2, True, torch.float32),
    (5, 60, 4, False, torch.float32),  # E not a power of two: padding lanes must never win
    (3, 512, 16, True, torch.float32),
    (37, 256, 8, True, torch.bfloat16),  # several programs of BLOCK_T rows; bf16 logit ties
])
def test_router_matches_torch(T, E, K, renorm, dtype):
    g = torch.Generator().manual_seed(T * 1000 + E)
    H = 32
    x = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(E, H, generator=g) / H**0.5).to(dtype)
    w_ref, ids_ref = torch_router(x, weight, K, renorm)
    w, ids = fused_router(x.to(DEVICE), weight.to(DEVICE), K, renorm)
    w, ids = w.cpu(), ids.cpu()
    assert ids.dtype == torch.int64 and w.dtype == dtype
    logits = F.linear(x, weight).float()  # [T, E] as the Router
    stable = torch.sort(-logits, dim=-1, stable=True).indices[:, :K]  # [T, K] ties: lowest id
    assert ids.tolist() == stable.tolist()
    probs = F.softmax(logits, dim=-1)
    kth, next_p = torch.sort(probs, -1, descending=True).values[:, K - 1:K + 1].unbind(-1)
    clear = kth > next_p  # rows where no tie straddles the K-th place
    assert all(set(a) == set(b) for a, b, c in
               zip(ids.tolist(), ids_ref.tolist(), clear.tolist()) if c)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # GPU exp ~1e-6; one bf16 ulp
    # weights come out descending in both, so equal-weight ties do not disturb this comparison
    torch.testing.assert_close(w[clear].float(), w_ref[clear].float(), rtol=tol, atol=1e-7)
    if renorm:
        assert torch.allclose(w.float().sum(-1), torch.ones(T), atol=K * tol)


def test_ties_go_to_the_lowest_expert_id():
    """Three equal maxima and K=2: ids 1 and 3 (torch.topk's tie order is unspecified)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    w, ids = router_topk(logits.to(DEVICE), 2, True, torch.float32)
    assert ids.cpu().tolist() == [[1, 3]]
    assert torch.allclose(w.cpu(), torch.tensor([[0.5, 0.5]]))


def test_underflowed_probabilities_still_rank_by_logit():
    """K beyond the experts with p > 0 (exp underflows to 0): the rest rank by logit, then id,
    never a padding lane of the power-of-two block (E=6 -> 16 lanes) nor an expert twice."""
    logits = torch.tensor([[-200.0, 0.0, -200.0, -300.0, -250.0, float("-inf")]])
    w, ids = router_topk(logits.to(DEVICE), 6, False, torch.float32)
    assert ids.cpu().tolist() == [[1, 0, 2, 4, 3, 5]]
    assert w.cpu().tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


def test_bad_top_k_raises():
    with pytest.raises(ValueError, match="top_k"):
        router_topk(torch.zeros(2, 4, device=DEVICE), 5, True, torch.float32)


def test_row_mask_routes_padding_rows_nowhere():
    """Bug it catches: a graph bucket's padding rows routed to real experts (fetches and compute
    for nothing, or -1 written into real rows) once the mask moved into the kernel."""
    g = torch.Generator().manual_seed(3)
    T, E, K, H = 5, 16, 4, 32
    x = torch.randn(T, H, generator=g)
    weight = torch.randn(E, H, generator=g) / H**0.5
    mask = torch.tensor([True, False, True, True, False])
    w0, ids0 = fused_router(x.to(DEVICE), weight.to(DEVICE), K, True)
    w, ids = fused_router(x.to(DEVICE), weight.to(DEVICE), K, True, row_mask=mask.to(DEVICE))
    assert (ids.cpu()[~mask] == -1).all()
    assert torch.equal(ids.cpu()[mask], ids0.cpu()[mask])
    assert torch.equal(w.cpu(), w0.cpu())  # weights as without the mask
    _, ids_ref = torch_router_masked(x, weight, K, mask)
    assert torch.equal(ids_ref[~mask], ids.cpu()[~mask])


def torch_router_masked(x, weight, top_k, mask):
    """Router.forward's torch path with a row mask (the CPU reference)."""
    r = Router(weight.shape[1], weight.shape[0], top_k, True)
    with torch.no_grad():
        r.weight.copy_(weight)
        return r(x, row_mask=mask)


def test_row_mask_must_be_bool_per_row():
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="row_mask"):
        fused_router(x.to(DEVICE), weight.to(DEVICE), 2, True,
                     row_mask=torch.ones(3, dtype=torch.bool, device=DEVICE))
