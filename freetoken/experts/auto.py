"""`auto`: the profile's choice of backend, guarded on the live workload.

`AutoGuard` runs the choice, then, after a warm-up, times plain offload over the same number
of decode steps and falls back to it if the choice was slower; steps that still compile or
capture kernels are left untimed. `AutoExperts` is the layer: a
`CpuSplitExperts` whose fetch rule is the guard's (its choice's rule, or every miss while
offload is timed), so one captured graph serves both phases: the device table the decision
reads is rewritten in place when the phase changes.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.split import CpuSplitExperts, FetchRule
from freetoken.experts.store import ExpertStore
from freetoken.log import get_logger, kv

log = get_logger("experts")


class AutoGuard:
    """`auto`: runs the profile's choice, then guards it on the live workload — after a warm-up
    it times plain offload over the same number of decode steps and falls back to it if the
    choice was slower.

    `on_step` is called once at the start of every forward step by what runs the step
    (`MoERuntime.step`, entered by `EngineCore.step` and `generate`), with `decode=True` when
    every row of the step is one token of a decoding sequence, however many sequences there
    are (`width`), and `end_step` once its tokens are on the host. The caller knows the step's
    kind; a layer sees only a token count, which cannot tell 3 decode rows from a 3-token
    prefill chunk. Only the decode steps' own durations are summed: the time between steps
    (an idle server, the warm-up before the first request, the host's handling of the tokens)
    is not the backend's.

    Kernels still warming up are not the backend's either (issue #20 item 4: the choice,
    timed first, paid every JIT compile and graph capture and lost to offload): in each phase
    the first `discard` decode steps of every width go untimed, and so does any step that
    captured a graph (`discard_step`, called by the decode runner). The phases are compared
    width by width over the widths both saw, weighted by the choice phase's step counts (a
    phase of 4-row steps is not compared with one of 1-row steps); with no width in common,
    by their overall means."""

    def __init__(self, choice: str, q_choice: Callable[[int], int], window: int = 32,
                 discard: int = 2):
        self.choice, self.q_choice, self.window, self.discard = choice, q_choice, window, discard
        self.phase, self.steps, self.elapsed = "choice", 0, 0.0
        self._start: float | None = None  # start of the current decode step, if timed
        self._width = 1
        self._seen: dict[int, int] = {}  # decode steps per width in this phase, untimed included
        # per phase and width: [seconds, steps] of the timed steps
        self.by_width: dict[str, dict[int, list]] = {"choice": {}, "offload": {}}
        self.times: dict[str, float] = {}
        self.discarded = 0
        # called after each change of phase (the rule `num_fetch` follows may change with it):
        # captured layers rewrite their device fetch tables
        self.listeners: list[Callable[[], None]] = []

    @property
    def settled(self) -> bool:
        """Done timing: steps need no marking any more (the engine may overlap them)."""
        return self.phase == "settled"

    def num_fetch(self, misses: int) -> int:
        return self.q_choice(misses) if self.phase in ("choice", "settled") else -1

    def on_step(self, decode: bool, width: int = 1) -> None:
        self._start = None
        if not decode or self.phase == "settled":
            return
        n = self._seen.get(width, 0)
        self._seen[width] = n + 1
        if n < self.discard:  # this width's first steps in the phase: kernels may still warm
            self.discarded += 1
            return
        self._width, self._start = width, time.perf_counter()

    def discard_step(self) -> None:
        """The current step compiled or captured something: leave it untimed."""
        if self._start is not None:
            self._start = None
            self.discarded += 1

    def end_step(self) -> None:
        if self._start is None:
            return
        dt = time.perf_counter() - self._start
        self._start = None
        acc = self.by_width[self.phase].setdefault(self._width, [0.0, 0])
        acc[0] += dt
        acc[1] += 1
        self.elapsed += dt
        self.steps += 1
        if self.steps < self.window:
            return
        self.times[self.phase] = self.elapsed / self.window
        self.steps, self.elapsed, self._seen = 0, 0.0, {}
        if self.phase == "choice":
            self.phase = "offload"
            self._changed()
            return
        chosen_s, offload_s, widths = self._compare()
        fields = {"chosen_ms": f"{chosen_s * 1e3:.2f}", "offload_ms": f"{offload_s * 1e3:.2f}",
                  "widths": ",".join(map(str, widths)) or "none", "discarded": self.discarded}
        if offload_s < chosen_s:
            log.warning(kv("auto_fallback", chosen=self.choice, to="offload", **fields))
            self.choice, self.q_choice = "offload", (lambda m: -1)
        else:
            log.info(kv("auto_keep", chosen=self.choice, **fields))
        self.phase = "settled"
        self._changed()

    def _compare(self) -> tuple[float, float, list[int]]:
        """Seconds per step of the choice and of offload over the widths both phases timed
        (weighted by the choice's counts), or their overall means when none is common."""
        c, o = self.by_width["choice"], self.by_width["offload"]
        common = sorted(set(c) & set(o))
        if not common:
            return self.times["choice"], self.times["offload"], []
        n = sum(c[w][1] for w in common)
        chosen = sum(c[w][0] for w in common) / n
        offload = sum(c[w][1] * o[w][0] / o[w][1] for w in common) / n
        return chosen, offload, common

    def _changed(self) -> None:
        for fn in self.listeners:
            fn()


class GuardRule(FetchRule):
    """The fetch rule the guard runs now: its choice's, or -1 (every miss) while it times
    offload."""

    def __init__(self, guard: AutoGuard):
        self.guard = guard

    def __call__(self, misses: int) -> int:
        return self.guard.num_fetch(misses)


class AutoExperts(CpuSplitExperts):
    """One MoE layer under `auto` (see the module docstring)."""

    def __init__(self, moe_index: int, cache: SlotCache, store: ExpertStore, stats,
                 guard: AutoGuard, cpu_threads: int | None = None, streamer=None):
        super().__init__("auto", moe_index, cache, store, stats, GuardRule(guard), cpu_threads,
                         streamer)
        self.guard = guard

    def _device_num_fetch(self) -> int | Tensor:
        new = self._fetch_table is None
        table = super()._device_num_fetch()
        if new:  # the guard's phase changes rewrite the table the graph holds
            self.guard.listeners.append(self._refresh_fetch_table)
        return table

    def _refresh_fetch_table(self) -> None:
        """The guard changed phase: the table takes the rule it follows now (between steps;
        the guard's caller has the step's tokens, so no replay reads the table meanwhile)."""
        assert self._fetch_table is not None
        with torch.inference_mode():  # the table was made inside a forward
            self._fetch_table.copy_(torch.tensor(self.rule.table(self.store.num_experts),
                                                 dtype=torch.int64))
