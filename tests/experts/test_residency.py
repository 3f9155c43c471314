"""decide_reference and resize against the OrderedDict LRU model, invariants after every step."""
from __future__ import annotations

import random

import pytest
import torch

from freetoken.experts.residency import ResidencyTable
from tests.experts.invariants import check_against_model, check_decision, check_tables
from tests.experts.lru_model import LruModel


def random_ids(rng: random.Random, T: int, K: int, E: int, pad: bool) -> torch.Tensor:
    rows = []
    for _ in range(T):
        row = rng.sample(range(E), K)  # a router never repeats an expert within one token
        if pad and rng.random() < 0.2:
            row = [-1] * K  # a padded batch row
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_lru_model(seed: int) -> None:
    rng = random.Random(seed)
    L, E = rng.randint(1, 3), rng.randint(4, 8)
    S = rng.randint(1, 12)
    t, m = ResidencyTable(L, E, S), LruModel(E, S)
    for _ in range(60):
        layer = rng.randrange(L)
        T, K = rng.randint(1, 4), rng.randint(1, min(4, E))
        ids = random_ids(rng, T, K, E, pad=True)
        nf = rng.choice([-1, -1, 0, 1, 2, 5])
        d = t.decide(layer, ids, nf)
        slot_ids, fetch, victims, counts = m.step(layer, ids.tolist(), nf)
        assert d.slot_ids.tolist() == slot_ids
        q = counts[2]
        assert d.fetch_experts[:q].tolist() == fetch
        assert d.fetch_slots[:q].tolist() == victims
        assert tuple(d.counters.tolist()) == counts
        check_tables(t)
        check_decision(t, layer, ids, d)
        check_against_model(t, m)


def test_tie_break_and_victim_choice_by_hand() -> None:
    t = ResidencyTable(1, 8, 3)
    d = t.decide(0, torch.tensor([[5, 2, 7]]))  # empty slots fill in slot order
    assert d.fetch_experts.tolist() == [2, 5, 7] and d.fetch_slots.tolist() == [0, 1, 2]
    d = t.decide(0, torch.tensor([[5, 1, 0]]), num_fetch=1)  # 5 hit; 0 and 1 miss
    assert d.counters.tolist() == [1, 2, 1]
    # miss order by count then id: 0 first; victim = LRU slot not holding 5, lowest index: 0 (2)
    assert d.fetch_experts.tolist()[:1] == [0] and d.fetch_slots.tolist()[:1] == [0]
    assert d.slot_ids.tolist() == [[1, -1, 0]] and d.cpu_mask.tolist() == [[False, True, False]]
    d = t.decide(0, torch.tensor([[3, 4], [3, 6]]), num_fetch=-1)  # 3 routed twice goes first
    assert d.fetch_experts.tolist()[:2] == [3, 4] and d.fetch_slots.tolist()[:2] == [2, 0]


def test_resize_matches_model() -> None:
    rng = random.Random(7)
    L, E, S = 3, 8, 10
    t, m = ResidencyTable(L, E, S), LruModel(E, S)
    for i in range(80):
        if i % 10 == 9:
            new = rng.randint(0, 12)
            src, dst = t.resize(new)
            m.resize(new)
            assert src.numel() == dst.numel() and bool((dst < new).all())
        else:
            layer = rng.randrange(L)
            ids = random_ids(rng, rng.randint(1, 3), 3, E, pad=False)
            nf = rng.choice([-1, 1])
            d = t.decide(layer, ids, nf)
            assert d.slot_ids.tolist() == m.step(layer, ids.tolist(), nf)[0]
            check_decision(t, layer, ids, d)
        check_tables(t)
        check_against_model(t, m)


def test_no_slots_sends_everything_to_cpu() -> None:
    t = ResidencyTable(2, 4, 0)
    d = t.decide(1, torch.tensor([[0, 3]]))
    assert d.cpu_mask.all() and d.fetch_experts.numel() == 0 and d.counters.tolist() == [0, 2, 0]
