"""Invariant battery for a ResidencyTable, run after every operation in the tests."""
from __future__ import annotations

import torch

from freetoken.experts.residency import Decision, ResidencyTable
from tests.experts.lru_model import LruModel


def check_tables(t: ResidencyTable) -> None:
    owner, eslot, last = t.slot_owner.tolist(), t.expert_slot.tolist(), t.slot_last_use.tolist()
    for s, g in enumerate(owner):
        if g >= 0:
            assert eslot[g] == s, f"slot {s} owned by {g} but expert_slot={eslot[g]}"
            assert 0 <= last[s] <= int(t.clock), f"slot {s} last_use {last[s]}"
        else:
            assert last[s] == -1, f"empty slot {s} has last_use {last[s]}"
    for g, s in enumerate(eslot):
        if s >= 0:
            assert owner[s] == g, f"expert {g} in slot {s} but owner={owner[s]}"
    assert sum(s >= 0 for s in eslot) == sum(g >= 0 for g in owner) <= t.num_slots


def check_decision(t: ResidencyTable, layer: int, ids: torch.Tensor, d: Decision) -> None:
    base = layer * t.num_experts
    owner, last = t.slot_owner.tolist(), t.slot_last_use.tolist()
    now = int(t.clock)
    for x, s, c in zip(ids.flatten().tolist(), d.slot_ids.flatten().tolist(),
                       d.cpu_mask.flatten().tolist()):
        assert c == (x >= 0 and s < 0)
        if s >= 0:
            assert owner[s] == base + x, "GPU entry's slot does not hold its expert"
            assert last[s] == now, "used slot not refreshed"
    q = int(d.counters[2])
    assert (d.fetch_experts[q:] == -1).all() and (d.fetch_slots[q:] == -1).all()
    for e, s in zip(d.fetch_experts[:q].tolist(), d.fetch_slots[:q].tolist()):
        assert owner[s] == base + e


def check_against_model(t: ResidencyTable, m: LruModel) -> None:
    """Same residents in the same slots, and the table's (last_use, slot) order = model order."""
    owner, last = t.slot_owner.tolist(), t.slot_last_use.tolist()
    assert t.num_slots == m.S
    assert {g: s for s, g in enumerate(owner) if g >= 0} == dict(m.lru)
    order = [owner[s] for s in sorted((s for s in range(len(owner)) if owner[s] >= 0),
                                      key=lambda s: (last[s], s))]
    assert order == list(m.lru), "recency order differs from the LRU model"
