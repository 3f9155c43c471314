"""The elastic-VRAM planner's rules (engine/vram_plan.py), on hand-computed readings: bytes in
units of one expert slot (S) and one KV token (T) so every expected size is arithmetic."""
from __future__ import annotations

from freetoken.engine.vram_plan import VramKnobs, VramState, plan

S, T, M = 1000, 10, 5000  # slot bytes, KV token bytes, margin
K = VramKnobs(margin_bytes=M, hysteresis_bytes=500)


def _st(free: int, slots: int = 40, kv: int = 1000, live: int = 0, floor: int = 200,
        cap: int = 4000) -> VramState:
    return VramState(free, slots, 64, S, kv, T, floor, live, cap, min_expert_slots=8)


def test_inside_the_band_nothing_changes() -> None:
    """Free memory within the hysteresis band around the margin: no plan (no thrash)."""
    for free in (M - 500, M, M + 499):
        assert plan(_st(free), K) is None


def test_a_claim_is_paid_by_experts_first_then_kv_down_to_its_floor() -> None:
    p = plan(_st(M - 3 * S), K)  # 3 slots' worth claimed
    assert (p.expert_slots, p.kv_tokens, p.reason) == (37, 1000, "memory_claimed")
    p = plan(_st(M - 40 * S), K)  # more than the experts can give above their minimum (8)
    assert p.expert_slots == 8
    assert p.kv_tokens == 1000 - (40 - 32) * S // T  # the rest from KV: 800 tokens
    p = plan(_st(M - 60 * S, live=500), K)  # KV never under the live tokens (or the floor)
    assert (p.expert_slots, p.kv_tokens) == (8, 500)


def test_returned_memory_grows_the_experts_up_to_the_pool() -> None:
    p = plan(_st(M + 5 * S + 1), K)
    assert (p.expert_slots, p.kv_tokens, p.reason) == (45, 1000, "memory_returned")
    p = plan(_st(M + 100 * S), K)
    assert p.expert_slots == 64  # the whole pool, no more
    assert plan(_st(M + 100 * S, slots=64), K) is None  # experts full: KV grows on demand only


def test_a_budget_the_user_set_caps_the_growth_not_the_shrink() -> None:
    """`max_expert_slots` (the user's --moe-cache-rate/-size/-mem): returned memory grows the
    experts back up to it and no further; a claim still shrinks below it. Bug it catches: a
    20-layer H200 server started at --moe-cache-rate 0.37 (1,894 slots) grew to all 5,120
    experts 3 s after ready, so its figures were no longer those of a 37 % cache."""
    from dataclasses import replace

    st = replace(_st(M + 100 * S), max_expert_slots=50)
    assert plan(st, K).expert_slots == 50
    assert plan(replace(st, expert_slots=50), K) is None
    p = plan(replace(_st(M - 3 * S, slots=50), max_expert_slots=50), K)
    assert (p.expert_slots, p.reason) == (47, "memory_claimed")
    assert plan(replace(_st(M + 100 * S), max_expert_slots=500), K).expert_slots == 64  # pool


def test_kv_pressure_moves_budget_from_experts() -> None:
    """Live tokens past 85% of the pool: the pool grows to 1.5x live, paid from the memory
    above the margin first, then by expert slots; never past the cap."""
    p = plan(_st(M, live=900), K)
    assert p.reason == "kv_pressure" and p.kv_tokens == 1350
    assert p.expert_slots == 40 - 350 * T // S - 1  # 3500 bytes: 4 slots (rounded up)
    p = plan(_st(M + 2000, live=900), K)  # 2000 bytes free above the margin pay 200 tokens
    assert (p.kv_tokens, p.expert_slots) == (1350, 38)
    p = plan(_st(M, live=3900, kv=4000), K)
    assert p is None  # at the cap
    p = plan(_st(M, slots=9, live=900), K)  # one slot to give: the pool grows by its worth
    assert (p.expert_slots, p.kv_tokens) == (8, 1100)


def _st_state(free: int, slots: int = 40, states: int = 12, live: int = 3) -> VramState:
    """`_st` with a state pool: 12 slots of 2000 bytes, floor 4, `live` that must stay."""
    return VramState(free, slots, 64, S, 1000, T, 200, 0, 4000, min_expert_slots=8,
                     state_slots=states, state_slot_bytes=2 * S, state_floor=4,
                     state_live=live, state_cap=12)


def test_a_claim_reaches_the_state_pool_last_and_stops_at_its_floor() -> None:
    """Experts (32 slots above their minimum) and KV (800 tokens above its floor: 8 slots'
    worth) pay first; what is left comes from state slots, never below the floor nor the live
    states. Without a state pool (the fields at 0) nothing changes from before."""
    p = plan(_st_state(M - 40 * S), K)
    assert (p.expert_slots, p.kv_tokens, p.state_slots) == (8, 200, 12)  # paid in full
    p = plan(_st_state(M - 46 * S), K)  # 6 slots' worth more: 3 state slots
    assert (p.expert_slots, p.kv_tokens, p.state_slots) == (8, 200, 9)
    assert plan(_st_state(M - 100 * S), K).state_slots == 4  # the floor
    assert plan(_st_state(M - 100 * S, live=6), K).state_slots == 6  # the live states
    assert plan(_st(M - 100 * S), K).state_slots == 0


def test_returned_memory_regrows_the_state_pool_first() -> None:
    p = plan(_st_state(M + 5 * S, states=6), K)  # 5 slots' worth: 2 state slots, 1 expert
    assert (p.state_slots, p.expert_slots, p.reason) == (8, 41, "memory_returned")
    p = plan(_st_state(M + 100 * S, states=6), K)
    assert (p.state_slots, p.expert_slots) == (12, 64)  # back to --state-slots, no more
    p = plan(_st_state(M + 5 * S, slots=64, states=6), K)  # experts full: state alone
    assert (p.state_slots, p.expert_slots) == (8, 64)
    assert plan(_st_state(M + 5 * S, slots=64), K) is None  # both full
