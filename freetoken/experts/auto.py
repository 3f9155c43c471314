"""`auto`: the fastest of its candidates on the live workload, the profile's choice timed first.

`AutoGuard` times every backend the layer can run with one captured graph — `offload` (fetch
every miss), `hybrid` (the runtime's q* rule, when a bandwidth profile measured it) and `cpu`
(fetch none) — over the same number of decode steps, in short turns that take the candidates
in a serpentine order (the profile's choice first), and settles on the fastest; steps that
still compile or capture kernels are left untimed. `AutoExperts` is the layer: a
`CpuSplitExperts` whose fetch rule is the guard's (the candidate it times now, then the one it
settled on), so one captured graph serves every phase: the device table the decision reads is
rewritten in place when the phase changes.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.split import CpuSplitExperts, FetchRule, FixedRule
from freetoken.experts.store import ExpertStore
from freetoken.log import get_logger, kv

log = get_logger("experts")

# the backends `auto` may settle on, in the order it times those after the profile's choice
CANDIDATES = ("offload", "hybrid", "cpu")
# timed decode steps per candidate, untimed warm steps per width, timed steps a turn (AutoGuard)
WINDOW, DISCARD, TURN = 32, 2, 8


def candidate_rules(choice: str, q_rule: FetchRule | None) -> dict[str, FetchRule]:
    """The fetch rule of every candidate the layer can run, the profile's `choice` first, then
    the others in `CANDIDATES` order. `q_rule`: hybrid's q* rule from a measured profile, or
    None when there is none (fallback bandwidths are not this machine's split: hybrid is left
    out). offload and cpu need nothing more than the slot cache and the CPU branch, which
    every `auto` layer has (the bridge in captured steps, the eager worker otherwise)."""
    rules: dict[str, FetchRule] = {"offload": FixedRule(-1), "cpu": FixedRule(0)}
    if q_rule is not None:
        rules["hybrid"] = q_rule
    if choice not in rules:
        raise ValueError(f"auto's choice {choice!r} cannot run here (candidates: "
                         f"{', '.join(rules)})")
    return {n: rules[n] for n in (choice, *(c for c in CANDIDATES if c != choice)) if n in rules}


class AutoGuard:
    """`auto`'s timing of its candidates (`candidates`: name -> fetch rule, in timing order, the
    profile's choice first), then the fastest one's rule for good.

    `on_step` is called once at the start of every forward step by what runs the step
    (`MoERuntime.step`, entered by `EngineCore.step` and `generate`), with `decode=True` when
    every row of the step is one token of a decoding sequence, however many sequences there
    are (`width`), and `end_step` once its tokens are on the host. The caller knows the step's
    kind; a layer sees only a token count, which cannot tell 3 decode rows from a 3-token
    prefill chunk. Only the decode steps' own durations are summed: the time between steps
    (an idle server, the warm-up before the first request, the host's handling of the tokens)
    is not the backend's.

    Each candidate (`phase`) runs for a turn of `turn` timed decode steps, then the next one,
    round after round, until every candidate has `window` timed steps; a round takes the
    candidates in order, the next one in reverse (A B C C B A A B C ...), so a drift that
    every candidate meets alike cancels. The workload's own warm-up is such a drift: the
    expert cache fills toward the decode's hot set over the first tens of steps (`cpu` fills
    nothing, `offload` fills every miss), and timed one after the other for a whole window
    each (turn = window), the last candidate met the warmest cache: on the H200's replayed
    router at batch 4 the guard timed offload (second) at 6.33 ms/step and hybrid (third)
    at 3.84 and kept hybrid, which then decoded at 654 tok/s against offload's 1022
    (session 19). Kernels still warming up are not the backend's (issue #20 item 4: the choice,
    timed first, paid every JIT compile and graph capture and lost to offload): in each phase
    the first `discard` decode steps of every width of each candidate go untimed, and so does
    any step that
    captured a graph (`discard_step`, called by the decode runner). The candidates are compared
    width by width over the widths every one of them timed, weighted by the first phase's step
    counts (a phase of 4-row steps is not compared with one of 1-row steps); with no width in
    common, by their overall means. A tie keeps the earlier candidate (the profile's choice
    first). `choice` is the profile's choice until the guard settles, then the fastest."""

    def __init__(self, candidates: dict[str, Callable[[int], int]], window: int = WINDOW,
                 discard: int = DISCARD, turn: int = TURN):
        if not candidates:
            raise ValueError("auto needs at least one candidate backend")
        if window < 1 or turn < 1:
            raise ValueError(f"auto's window and turn must be >= 1, got {window}, {turn}")
        self.rules = dict(candidates)
        self.order = list(self.rules)
        self.window, self.discard, self.turn = window, discard, min(turn, window)
        self._width = 1
        self.discarded = 0
        self.decode_steps = 0  # decode steps marked while timing, untimed ones included
        # called after each change of phase (the rule `num_fetch` follows changes with it):
        # captured layers rewrite their device fetch tables
        self.listeners: list[Callable[[], None]] = []
        self.retimed = 0  # times the timing started over (`retime`)
        self._start_timing()

    def _start_timing(self) -> None:
        """Every candidate untimed, the first one running (at start, and on `retime`)."""
        self.choice = self.phase = self.order[0]
        self.steps = 0  # timed steps of the current turn
        self._start: float | None = None  # start of the current decode step, if timed
        # per candidate: decode steps per width, untimed included (the first `discard` of each
        # width warm kernels), and its timed steps and their seconds over all its turns
        self._seen: dict[str, dict[int, int]] = {n: {} for n in self.order}
        self._timed: dict[str, list] = {n: [0.0, 0] for n in self.order}
        self._turns = self._schedule()
        # per candidate and width: [seconds, steps] of the timed steps
        self.by_width: dict[str, dict[int, list]] = {n: {} for n in self.order}
        self.times: dict[str, float] = {}  # per candidate timed: mean seconds per step
        self.compared: dict[str, float] = {}  # once settled: seconds per step as compared
        self.widths: list[int] = []  # once settled: the widths compared ([]: overall means)
        self.settled_after: int | None = None  # decode_steps when the guard settled
        if len(self.order) == 1:  # nothing to compare
            self.phase, self.settled_after = "settled", 0

    def retime(self, why: str) -> None:
        """Time every candidate again from the first: the paths they run changed (the CPU
        bridge was dropped, so the CPU share now runs eagerly), and timings taken before
        are not comparable with those after."""
        if len(self.order) == 1:
            return
        self.retimed += 1
        self._start_timing()
        log.info(kv("auto_retime", why=why, candidates=",".join(self.order),
                    times=self.retimed))
        self._changed()

    @property
    def settled(self) -> bool:
        """Done timing: steps need no marking any more (the engine may overlap them)."""
        return self.phase == "settled"

    @property
    def running(self) -> str:
        """The candidate whose rule the layers follow now."""
        return self.choice if self.settled else self.phase

    def num_fetch(self, misses: int) -> int:
        return self.rules[self.running](misses)

    def _schedule(self) -> list[str]:
        """The candidate of every turn after the first: serpentine rounds until each has
        `window` timed steps (a candidate's last turn may be shorter)."""
        rounds = -(-self.window // self.turn)
        out = [n for r in range(rounds)
               for n in (self.order if r % 2 == 0 else self.order[::-1])]
        return out[1:]

    def on_step(self, decode: bool, width: int = 1) -> None:
        self._start = None
        if not decode or self.settled:
            return
        self.decode_steps += 1
        seen = self._seen[self.phase]
        n = seen.get(width, 0)
        seen[width] = n + 1
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
        tot = self._timed[self.phase]
        tot[0] += dt
        tot[1] += 1
        self.steps += 1
        if tot[1] >= self.window:
            self.times[self.phase] = tot[0] / tot[1]
        elif self.steps < self.turn:
            return
        self._next_turn()

    def _next_turn(self) -> None:
        """The next turn's candidate (one with steps still to time), or settle."""
        self.steps = 0
        was = self.phase
        while self._turns:
            n = self._turns.pop(0)
            if self._timed[n][1] < self.window:
                self.phase = n
                break
        else:
            self._settle()
        if self.phase != was:  # (a serpentine round's end: the same candidate again)
            self._changed()

    def _settle(self) -> None:
        per, self.widths = self._compare()
        best = self.order[0]
        for n in self.order[1:]:
            if per[n] < per[best] * (1 - 1e-9):  # (as recommend_backend: ties go to the first)
                best = n
        first = self.order[0]
        self.compared, self.choice, self.phase = per, best, "settled"
        self.settled_after = self.decode_steps
        ms = {f"{n}_ms": f"{per[n] * 1e3:.2f}" for n in self.order}
        # warning when the live workload overrules the profile (its figures may be stale)
        say = log.info if best == first else log.warning
        # how far the runner-up is behind: a near-tie (a few %) is within a step's noise
        rest = [per[n] for n in self.order if n != best]
        margin = (min(rest) / per[best] - 1) * 100 if rest and per[best] > 0 else 0.0
        say(kv("auto_settled", chosen=best, profile_choice=first, **ms,
               margin_pct=f"{margin:.1f}", widths=",".join(map(str, self.widths)) or "none",
               steps=self.decode_steps, discarded=self.discarded, turn=self.turn))

    def _compare(self) -> tuple[dict[str, float], list[int]]:
        """Seconds per step of every candidate over the widths all of them timed (weighted by
        the first phase's counts), or their overall means when no width is common to all."""
        bw = self.by_width
        common = sorted(set.intersection(*(set(bw[n]) for n in self.order)))
        if not common:
            return {n: self.times[n] for n in self.order}, []
        first = bw[self.order[0]]
        total = sum(first[w][1] for w in common)
        return {n: sum(first[w][1] * bw[n][w][0] / bw[n][w][1] for w in common) / total
                for n in self.order}, common

    def summary(self) -> dict:
        """What /v1/stats shows of `auto`: the phase, the backend running, ms per step."""
        ms = self.compared if self.settled else self.times
        return {"phase": self.phase, "running": self.running, "candidates": list(self.order),
                "ms_per_step": {n: round(s * 1e3, 3) for n, s in ms.items()},
                "settled_after_steps": self.settled_after}

    def _changed(self) -> None:
        for fn in self.listeners:
            fn()


class GuardRule(FetchRule):
    """The fetch rule the guard runs now: the candidate it times, then the one it chose."""

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
