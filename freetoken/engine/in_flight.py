"""The decode step left in flight, and the one launched after it (the engine's half of the
decode overlap; the scheduler's half, which plans that next step, is scheduler/overlap.py).

A decode-only step through the runner is launched and left in flight; the next engine step
launches the step after it — the same requests, each fed the token the step in flight samples,
read on the device (`DecodeRunner.launch(chain=...)`) — before it reads the first step's
tokens and post-processes them, so the host's scheduling, staging and token handling run while
the GPU computes. It does so only when the scheduler plans that next step (certain up to stop
tokens, its KV allocated) and the expert runtime has settled (`auto`'s guard times each step
alone), and not while the runner waits for a safe point to switch its attention plan
(engine/plan_switch.py). A request that stops on a token while the step after it is in flight
keeps that step's work: its KV and state already cover the stop token, so it is committed with
it (the step's own token is dropped).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from freetoken.engine.graph_runner import DecodeRunner, Pending
from freetoken.engine.step_inputs import decode_row
from freetoken.experts.bridge import BridgeError
from freetoken.scheduler.overlap import schedule_ahead
from freetoken.scheduler.plan import BatchItem
from freetoken.scheduler.request import Request
from freetoken.scheduler.scheduler import Scheduler


@dataclass
class InFlight:
    """A decode step launched and not post-processed yet: its items in row order, the state
    ops to run after it, the runner's handle, when it was launched, and its tokens if they
    were read early (a request stopped while this step was in flight)."""

    items: list[BatchItem]
    post_ops: list
    pending: Pending
    t0: float
    tokens: list[int] | None = None


class DecodeOverlap:
    """The step in flight (`current`) over `runner`, the steps launched ahead of one in flight
    (`steps_ahead`), and the wall-time clock the statistics charge overlapping steps by.
    `settled()`: whether steps may be left in flight now."""

    def __init__(self, runner: DecodeRunner | None, sched: Scheduler, max_context: int,
                 settled: Callable[[], bool]):
        self.runner, self.sched, self.max_context = runner, sched, max_context
        self.settled = settled
        self.current: InFlight | None = None
        self.steps_ahead = 0  # decode steps launched before the previous one's tokens were read
        # a step after the one in flight that failed to launch: its requests and the error,
        # isolated once that one is post-processed (their states went past its tokens)
        self.failed: tuple[list[Request], Exception] | None = None
        self.t_done = 0.0  # when the last step's tokens were read
        self.wait_s = 0.0  # seconds blocked in the runner's collect, summed (EngineStats)

    def leave(self, items: list[BatchItem], post_ops: list, rows: list, t0: float) -> None:
        """Launch `rows` (the runner rows of `items`) and leave the step in flight."""
        assert self.runner is not None and self.current is None
        self.current = InFlight(items, post_ops, self.runner.launch(rows), t0)

    def advance(self) -> InFlight:
        """Take the step in flight and launch the step after it when the scheduler plans one
        (it becomes `current`); the caller post-processes the step returned."""
        cur = self.current
        assert cur is not None
        self.current = self._launch_ahead(cur)
        return cur

    def _launch_ahead(self, cur: InFlight) -> InFlight | None:
        if cur.tokens is not None or not self.settled():
            return None
        assert self.runner is not None
        if self.runner.switch_due():  # the next launch, unchained, switches the attention plan
            return None
        plan = schedule_ahead(self.sched, cur.items, self.max_context)
        if plan is None:
            return None
        t0 = time.perf_counter()
        rows = [decode_row(it, ahead=True) for it in plan.items]
        if not self.runner.fits(rows):
            plan.rollback(self.sched)
            return None
        try:
            pending = self.runner.launch(rows, chain=plan.chain)
        except BridgeError:
            raise
        except Exception as e:  # noqa: BLE001  (isolated once `cur` is post-processed)
            plan.rollback(self.sched)
            self.failed = ([it.req for it in plan.items], e)
            return None
        self.steps_ahead += 1
        return InFlight(plan.items, self.sched.cache.take_ops(), pending, t0)

    def collect(self, cur: InFlight) -> tuple[list[int], float]:
        """`cur`'s tokens and the seconds to charge it: a step launched while the previous one
        ran is charged from that one's end (the statistics' busy time is wall time, not
        launch-to-tokens summed over overlapping steps)."""
        assert self.runner is not None
        t_wait = time.perf_counter()
        toks = cur.tokens if cur.tokens is not None else self.runner.collect(cur.pending)
        now = time.perf_counter()
        self.wait_s += now - t_wait
        dt = now - max(cur.t0, self.t_done)
        self.t_done = now
        return toks, dt

    def ran_ahead(self, r: Request) -> bool:
        """`r` stops: whether the step in flight has a row of it. If so its tokens are read
        now (that row fed the stop token; `r`'s KV and state went past it)."""
        ahead = self.current
        if ahead is None or not any(it.req is r for it in ahead.items):
            return False
        if ahead.tokens is None:
            assert self.runner is not None
            ahead.tokens = self.runner.collect(ahead.pending)
        return True

    def take_failed(self) -> tuple[list[Request], Exception] | None:
        failed, self.failed = self.failed, None
        return failed
