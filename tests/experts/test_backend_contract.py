"""The ExpertBackend contract (freetoken/experts/base.py), checked against the one
reference expert FFN (freetoken/kernels/reference.py, float64): every backend the registry builds,
and every implementation of the expert FFN (grouped and gathered torch paths, the C++ CPU kernel),
on random routing with padding ids. Bug it catches: a backend that computes or fetches a padding
entry (-1 read as the last expert), weights applied twice, or a wrong bank row."""
from __future__ import annotations

import pytest
import torch

from freetoken.experts.ffn import dispatch_experts, gathered_experts
from freetoken.experts.registry import backend_names, create_backend
from freetoken.experts.runtime import MoERuntime
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.split import FetchRule
from freetoken.experts.stats import MoEStats
from freetoken.experts.store import ExpertStore
from freetoken.kernels.cpu.expert_ops import cpu_experts
from freetoken.kernels.reference import expert_ffn_reference
from freetoken.types.forward_batch import EAGER
from freetoken.types.model_config import expert_nbytes

L, E, H, I, K = 3, 6, 32, 16, 2


def _banks(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gu = [torch.randn(E, 2 * I, H, generator=g) * 0.3 for _ in range(L)]
    dn = [torch.randn(E, H, I, generator=g) * 0.3 for _ in range(L)]
    return gu, dn


def _batch(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # distinct per row
    ids[0, 1] = -1  # padding entry
    if T > 2:
        ids[2] = -1  # a whole padding row (a graph bucket's)
    return x, ids


class _Half(FetchRule):
    """A hybrid rule that fetches half the misses (at least one)."""

    def __call__(self, misses: int) -> int:
        return max(1, misses // 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-30)).item()


def test_registry_knows_every_backend_and_refuses_others() -> None:
    assert set(backend_names()) == {"fused", "offload", "cpu", "hybrid", "auto"}
    with pytest.raises(ValueError, match="unknown expert backend"):
        create_backend("gpu-magic", 0)


@pytest.mark.parametrize("name", ["fused", "offload", "cpu", "hybrid"])
@pytest.mark.parametrize("T", [1, 4])
def test_backend_matches_reference(name: str, T: int) -> None:
    gu, dn = _banks()
    store = ExpertStore(gu, dn, pin=False)
    cache = SlotCache(L, E, H, I, num_slots=4, dtype=torch.float32)
    stats = MoEStats(store.expert_bytes)
    rt = MoERuntime(name, None if name == "fused" else cache, store, stats, top_k=K,
                    q_rule=_Half())
    for layer in range(L):
        x, ids = _batch(T, seed=10 * layer + T)
        be = create_backend(name, layer, rt)
        y, shared = be(x, ids, EAGER)
        assert shared is None  # (no shared expert given)
        want = expert_ffn_reference(x, ids, gu[layer], dn[layer])
        assert y.shape == (T, K, H) and y.dtype == x.dtype
        assert _rel(y, want) < 1e-5, (name, layer)
        assert torch.count_nonzero(y[ids < 0]) == 0  # padding: nothing computed
    if name == "cpu" or (name == "hybrid" and T > 1):  # (one miss per layer: hybrid fetches it)
        assert stats.as_dict()["cpu_experts"] > 0
    if name == "offload":
        assert stats.as_dict()["fetched"] > 0


@pytest.mark.parametrize("T", [1, 3, 9])
def test_every_ffn_implementation_matches_reference(T: int) -> None:
    gu, dn = _banks(3)
    x, ids = _batch(T, seed=T)
    want = expert_ffn_reference(x, ids, gu[0], dn[0])
    grouped = dispatch_experts(x, ids, gu[0], dn[0], torch.zeros(T, K, H))
    gathered = gathered_experts(x, ids, gu[0], dn[0], torch.zeros(T, K, H))
    cpp = cpu_experts(x, ids.clamp(min=0), gu[0], dn[0], compute_mask=ids >= 0)
    for name, y in (("grouped", grouped), ("gathered", gathered), ("cpu kernel", cpp)):
        assert _rel(y, want) < 1e-5, name


def test_expert_bytes_one_place() -> None:
    gu, dn = _banks()
    store = ExpertStore(gu, dn, pin=False)
    cache = SlotCache(L, E, H, I, num_slots=2, dtype=torch.bfloat16)
    assert store.expert_bytes == expert_nbytes(H, I, torch.float32) == 3 * H * I * 4
    assert cache.slot_bytes() == expert_nbytes(H, I, torch.bfloat16) == 3 * H * I * 2
