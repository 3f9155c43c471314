"""Slot allocator and state pool against a plain set of free slots."""
from __future__ import annotations

import random

import pytest
import torch

from freetoken.cache import SlotAllocator, StatePool


@pytest.mark.parametrize("seed", range(5))
def test_random_alloc_free_matches_a_set(seed: int) -> None:
    rng = random.Random(seed)
    a = SlotAllocator(50)
    free, held = set(range(50)), []
    for _ in range(400):
        if held and rng.random() < 0.5:
            batch = held.pop(rng.randrange(len(held)))
            a.free(batch)
            free |= set(batch.tolist())
        else:
            n = rng.randint(0, 12)
            got = a.alloc(n)
            if n > len(free):
                assert got is None
            else:
                assert got is not None and got.dtype == torch.long and got.numel() == n
                assert set(got.tolist()) <= free and len(set(got.tolist())) == n
                free -= set(got.tolist())
                held.append(got)
        assert a.num_free == len(free) and a.num_used == 50 - len(free)
        assert set(a.free_slots()) == free


def test_bad_frees_raise_and_change_nothing() -> None:
    a = SlotAllocator(4)
    got = a.alloc(2)
    assert got is not None
    a.free(got[:1])
    for bad in ([int(got[0])], [int(got[1]), int(got[1])], [4], [-1]):
        with pytest.raises(ValueError):
            a.free(bad)
    assert a.num_free == 3
    a.free([])
    assert a.alloc(5) is None and a.num_free == 3


def test_state_pool_alloc_one() -> None:
    p = StatePool(2)
    s0, s1 = p.alloc_one(), p.alloc_one()
    assert {s0, s1} == {0, 1} and p.alloc_one() is None
    p.free([s0])
    assert p.alloc_one() == s0
