"""The prefill budget's split (`scheduler/plan.py:water_fill`), against hand-computed shares:
smallest need first, each gets its need or an equal share of what is left, at least one token.
Bug it catches: a split that hands the long prompt the budget first (issue 12's starvation),
or one that gives a request nothing when the budget runs out (a decode-sized need stalls)."""
from __future__ import annotations

from freetoken.scheduler.plan import water_fill


def test_a_short_need_is_met_whole_beside_a_long_one() -> None:
    assert water_fill([(200_000, 1), (9, 2)], 512) == {2: 9, 1: 503}


def test_equal_needs_share_the_budget_equally() -> None:
    got = water_fill([(300, 1), (300, 2), (300, 3)], 512)
    assert got == {1: 170, 2: 171, 3: 171} and sum(got.values()) == 512


def test_what_a_small_need_leaves_goes_to_the_others() -> None:
    # 512 // 3 = 170 > 20: the 20 is met; (512 - 20) // 2 = 246 each for the others
    assert water_fill([(1000, 1), (20, 2), (1000, 3)], 512) == {2: 20, 1: 246, 3: 246}


def test_every_need_gets_a_token_when_the_budget_is_spent() -> None:
    assert water_fill([(5, 1), (5, 2)], 0) == {1: 1, 2: 1}
    assert water_fill([], 512) == {}
