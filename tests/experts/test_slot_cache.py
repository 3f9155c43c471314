"""SlotCache: after decide + fill (and across resizes) every GPU entry reads its own weights."""
from __future__ import annotations

import random

import torch

from freetoken.experts.slot_cache import SlotCache
from tests.experts.invariants import check_tables
from tests.experts.test_residency import random_ids

L, E, H, I = 3, 8, 4, 2


class Banks:
    """Host store whose weights encode (layer, expert), so a wrong copy cannot go unnoticed."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self._gu = [torch.randn(E, 2 * I, H, generator=g) for _ in range(L)]
        self._dn = [torch.randn(E, H, I, generator=g) for _ in range(L)]

    def gate_up(self, layer: int) -> torch.Tensor:
        return self._gu[layer]

    def down(self, layer: int) -> torch.Tensor:
        return self._dn[layer]


def check_weights(cache: SlotCache, store: Banks) -> None:
    for s, g in enumerate(cache.table.slot_owner.tolist()):
        if g >= 0:
            layer, e = divmod(g, E)
            assert torch.equal(cache.gate_up_slots[s], store.gate_up(layer)[e])
            assert torch.equal(cache.down_slots[s], store.down(layer)[e])


def test_fill_and_resize_keep_weights_exact() -> None:
    rng = random.Random(3)
    store = Banks()
    cache = SlotCache(L, E, H, I, num_slots=6, dtype=torch.float32)
    for i in range(40):
        if i % 8 == 7:
            cache.resize(rng.randint(0, 12))
            assert cache.gate_up_slots.shape == (cache.num_slots, 2 * I, H)
            assert cache.down_slots.shape == (cache.num_slots, H, I)
        else:
            layer = rng.randrange(L)
            ids = random_ids(rng, rng.randint(1, 3), 3, E, pad=False)
            d = cache.decide(layer, ids, rng.choice([-1, 1]))
            assert cache.fill(layer, d.fetch_experts, d.fetch_slots, store) == d.num_fetched
            for x, s in zip(ids.flatten().tolist(), d.slot_ids.flatten().tolist()):
                if s >= 0:
                    assert torch.equal(cache.gate_up_slots[s], store.gate_up(layer)[x])
        check_tables(cache.table)
        check_weights(cache, store)


def test_shrink_keeps_most_recent() -> None:
    store = Banks()
    cache = SlotCache(L, E, H, I, num_slots=4, dtype=torch.float32)
    for layer, e in [(0, 1), (1, 2), (2, 3), (0, 4)]:
        d = cache.decide(layer, torch.tensor([[e]]))
        cache.fill(layer, d.fetch_experts, d.fetch_slots, store)
    cache.resize(2)  # (2, 3) in slot 2 and (0, 4) in slot 3 survive and move to slots 0 and 1
    assert cache.table.slot_owner.tolist() == [2 * E + 3, 0 * E + 4]
    check_weights(cache, store)
