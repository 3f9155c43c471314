"""A clock for `auto`'s guard that the test advances: step times exactly as injected (sleeps on
a loaded 2-core machine overran the 5 ms margins), and helpers that drive the guard's steps."""
from __future__ import annotations

import types
from collections.abc import Callable

import pytest

from freetoken.experts.auto import AutoGuard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    import freetoken.experts.auto as auto_mod

    c = Clock()
    monkeypatch.setattr(auto_mod, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
    return c


def step(g: AutoGuard, clock: Clock, seconds: float, width: int = 1) -> None:
    """One decode step of `width` rows that lasts `seconds`."""
    g.on_step(decode=True, width=width)
    clock.sleep(seconds)
    g.end_step()


def drive(g: AutoGuard, clock: Clock, cost: Callable[[int, str], float],
          limit: int = 1000) -> list[str]:
    """Width-1 decode steps until the guard settles; `cost(i, running)` is step i's seconds
    under the candidate running then. Returns the candidate each step ran."""
    ran = []
    while not g.settled:
        assert len(ran) < limit, "the guard never settled"
        ran.append(g.running)
        step(g, clock, cost(len(ran) - 1, g.running))
    return ran
