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


def test_arguments_are_checked() -> None:
    for shape in ((0, 4, 2), (2, 0, 2), (2, 4, -1)):
        with pytest.raises(ValueError, match="bad table shape"):
            ResidencyTable(*shape)
    ResidencyTable(1, 1, 0)  # no slots is a valid table (everything on the CPU)
    fresh = ResidencyTable(2, 3, 4)  # -1 is "empty" everywhere (the kernel and SlotCache use it)
    for table in (fresh.slot_owner, fresh.expert_slot, fresh.slot_last_use):
        assert table.dtype == torch.int64 and table.tolist() == [-1] * table.numel()
    assert fresh.clock.tolist() == [0]
    t = ResidencyTable(2, 4, 2)
    for layer in (-1, 2):
        with pytest.raises(ValueError, match="out of range"):
            t.decide(layer, torch.tensor([[0]]))
    with pytest.raises(ValueError, match="unknown decide impl"):
        t.decide(0, torch.tensor([[0]]), impl="fast")
    with pytest.raises(ValueError, match="^num_slots must be >= 0$"):
        t.resize(-1)


def test_fetch_capacity_is_the_tightest_bound() -> None:
    """F = min(T*K, E, S): each bound binds in turn (the fetch lists have exactly F entries)."""
    from freetoken.experts.residency import fetch_capacity

    assert fetch_capacity(1, 2, 8, 8) == 2 and fetch_capacity(4, 4, 8, 16) == 8
    assert fetch_capacity(4, 4, 32, 3) == 3 and fetch_capacity(0, 4, 8, 8) == 0
    d = ResidencyTable(1, 8, 16).decide(0, torch.tensor([[1, 2]]))
    assert d.fetch_experts.numel() == 2 and d.fetch_slots.numel() == 2


def test_int32_ids_decide_like_int64() -> None:
    """A router or kernel may hand int32 ids; the decision must not depend on it."""
    a, b = ResidencyTable(2, 8, 3), ResidencyTable(2, 8, 3)
    for step in ([[5, 2, 7]], [[5, 1, 0]], [[3, 4], [3, 6]]):
        ids = torch.tensor(step)
        da, db = a.decide(1, ids.to(torch.int64), 2), b.decide(1, ids.to(torch.int32), 2)
        assert all(torch.equal(x, y) for x, y in zip(da, db))
        assert da.slot_ids.dtype == torch.int64


def test_resize_edges_and_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Shrinks that evict exactly the excess, keep expert 0 (global id 0 is a real owner, not
    'empty'), move tail survivors to the lowest free slots; grows and same-size resizes move
    nothing; every decision is one log line (the values below are worked by hand)."""
    t = ResidencyTable(1, 8, 6)
    with caplog.at_level("DEBUG", logger="ft.experts"):
        t.decide(0, torch.tensor([[2, 3, 4, 5]]))  # slots 0-3, clock 1
        t.decide(0, torch.tensor([[6]]))  # slot 4, clock 2
        t.decide(0, torch.tensor([[0]]))  # slot 5, clock 3
        assert t.resident_count() == 6
        src, dst = t.resize(6)  # same size: nothing moves
        assert src.numel() == 0 and dst.numel() == 0
        src, dst = t.resize(5)  # one too many: the LRU (expert 2, slot 0) goes, 0 moves in
        assert (src.tolist(), dst.tolist()) == ([5], [0])
        assert t.expert_slot[0].item() == 0 and t.expert_slot[2].item() == -1
        assert t.resident_count() == 5
        src, dst = t.resize(8)
        assert src.dtype == dst.dtype == torch.int64 and src.numel() == 0
        assert t.slot_owner[5:].tolist() == [-1] * 3 and t.slot_last_use[5:].tolist() == [-1] * 3
    check_tables(t)
    assert [r.getMessage() for r in caplog.records] == [
        "decide layer=0 hits=0 misses=4 fetched=4 evicted=0",
        "decide layer=0 hits=0 misses=1 fetched=1 evicted=0",
        "decide layer=0 hits=0 misses=1 fetched=1 evicted=0",
        "slots_grow old=6 new=6",
        "slots_shrink old=6 new=5 evicted=1 moved=1",
        "slots_grow old=5 new=8",
    ]
    u = ResidencyTable(1, 8, 6)
    u.decide(0, torch.tensor([[1, 2]]))
    u.resize(3)  # two residents fit in three slots: nobody is evicted
    assert u.resident_count() == 2 and u.expert_slot[1:3].tolist() == [0, 1]
