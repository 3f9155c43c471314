"""`auto`: the profile's choice of backend, guarded on the live workload.

`AutoGuard` runs the choice, then, after a warm-up, times plain offload over the same number
of decode steps and falls back to it if the choice was slower. `AutoExperts` is the layer: a
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
    are, and `end_step` once its tokens are on the host. The caller knows the step's kind; a
    layer sees only a token count, which cannot tell 3 decode rows from a 3-token prefill
    chunk. Only the decode steps' own durations
    are summed: the time between steps (an idle server, the warm-up before the first request,
    the host's handling of the tokens) is not the backend's."""

    def __init__(self, choice: str, q_choice: Callable[[int], int], window: int = 32):
        self.choice, self.q_choice, self.window = choice, q_choice, window
        self.phase, self.steps, self.elapsed = "choice", 0, 0.0
        self._start: float | None = None  # start of the current decode step, if timed
        self.times: dict[str, float] = {}
        # called after each change of phase (the rule `num_fetch` follows may change with it):
        # captured layers rewrite their device fetch tables
        self.listeners: list[Callable[[], None]] = []

    @property
    def settled(self) -> bool:
        """Done timing: steps need no marking any more (the engine may overlap them)."""
        return self.phase == "settled"

    def num_fetch(self, misses: int) -> int:
        return self.q_choice(misses) if self.phase in ("choice", "settled") else -1

    def on_step(self, decode: bool) -> None:
        self._start = (time.perf_counter() if decode and self.phase != "settled" else None)

    def end_step(self) -> None:
        if self._start is None:
            return
        self.elapsed += time.perf_counter() - self._start
        self._start = None
        self.steps += 1
        if self.steps < self.window:
            return
        self.times[self.phase] = self.elapsed / self.window
        self.steps, self.elapsed = 0, 0.0
        if self.phase == "choice":
            self.phase = "offload"
            self._changed()
            return
        if self.times["offload"] < self.times["choice"]:
            log.warning(kv("auto_fallback", chosen=self.choice, to="offload",
                           chosen_ms=f"{self.times['choice'] * 1e3:.2f}",
                           offload_ms=f"{self.times['offload'] * 1e3:.2f}"))
            self.choice, self.q_choice = "offload", (lambda m: -1)
        else:
            log.info(kv("auto_keep", chosen=self.choice,
                        chosen_ms=f"{self.times['choice'] * 1e3:.2f}",
                        offload_ms=f"{self.times['offload'] * 1e3:.2f}"))
        self.phase = "settled"
        self._changed()

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
