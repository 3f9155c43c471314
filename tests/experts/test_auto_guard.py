"""`auto`'s guard (experts/auto.py) on step durations the test controls: it times every
candidate it can run (offload, hybrid, cpu), the profile's choice first, and settles on the
fastest. Issue #20 item 4: on the H200 `auto` settled on offload (13.2 ms/step) because it only
ever compared its choice (cpu, 16.1) with offload, while hybrid served twice as fast; the
guard never tried hybrid. The oracle here is the minimum of the injected per-step costs."""
from __future__ import annotations

import itertools
import logging

import pytest
import torch

from freetoken.experts.auto import CANDIDATES, AutoGuard, candidate_rules
from freetoken.experts.split import FixedRule
from tests.experts.auto_clock import Clock, drive, step

RULES = {"offload": lambda m: -1, "cpu": lambda m: 0, "hybrid": lambda m: max(1, m // 2)}


def _guard(order, window: int = 4, discard: int = 0) -> AutoGuard:
    return AutoGuard({n: RULES[n] for n in order}, window=window, discard=discard)


@pytest.mark.parametrize("order", list(itertools.permutations(CANDIDATES)))
@pytest.mark.parametrize("fastest", CANDIDATES)
def test_guard_settles_on_the_fastest_of_three(clock: Clock, order, fastest: str) -> None:
    """Every order of the profile's choice and every candidate the fastest: the guard times
    each for its window in the given order and keeps the one with the smallest step time.
    Catches a guard that compares its choice with offload only (it keeps the choice, or
    offload, when the third candidate is the fastest)."""
    cost = {n: 0.012 + 0.002 * i for i, n in enumerate(c for c in CANDIDATES if c != fastest)}
    cost[fastest] = 0.010
    g = _guard(order, window=4, discard=2)
    ran = drive(g, clock, lambda i, running: cost[running])
    assert ran == [n for n in order for _ in range(6)]  # 2 untimed + 4 timed each, in order
    assert g.settled and g.choice == fastest and g.running == fastest
    assert g.num_fetch(6) == RULES[fastest](6)
    assert g.compared == pytest.approx(cost) and g.settled_after == 18 and g.discarded == 6


def test_a_tie_keeps_the_profiles_choice(clock: Clock) -> None:
    g = _guard(("cpu", "offload", "hybrid"))
    drive(g, clock, lambda i, running: 0.01)
    assert g.choice == "cpu"


def test_guard_compares_every_candidate_at_the_same_width(clock: Clock) -> None:
    """The choice timed at batch 4, the others mostly at batch 1: overall means (choice 25
    ms, offload 15, cpu 12.75) would pick cpu although both others are slower at batch 4
    (offload 30, cpu 27), the only width all three ran."""
    g = _guard(("hybrid", "offload", "cpu"))
    for _ in range(4):
        step(g, clock, 0.025, width=4)
    for s, w in ((0.010, 1), (0.010, 1), (0.010, 1), (0.030, 4)):
        step(g, clock, s, width=w)
    for s, w in ((0.008, 1), (0.008, 1), (0.008, 1), (0.027, 4)):
        step(g, clock, s, width=w)
    assert g.times["cpu"] < g.times["offload"] < g.times["hybrid"]  # what the means say
    assert g.settled and g.choice == "hybrid" and g.widths == [4]
    assert g.compared == pytest.approx({"hybrid": 0.025, "offload": 0.030, "cpu": 0.027})


def test_widths_are_weighted_by_the_first_phases_counts(clock: Clock) -> None:
    """The choice ran three 1-row steps and one 4-row step; offload one 1-row and three 4-row
    steps. Offload's own mean (33.75 ms) loses to the choice's (17.5), but on the choice's mix
    of widths it costs (3 x 9 + 42) / 4 = 17.25 ms: offload wins."""
    g = _guard(("hybrid", "offload", "cpu"))
    for s, w in ((0.010, 1), (0.010, 1), (0.010, 1), (0.040, 4)):
        step(g, clock, s, width=w)
    for s, w in ((0.009, 1), (0.042, 4), (0.042, 4), (0.042, 4)):
        step(g, clock, s, width=w)
    for s, w in ((0.020, 1), (0.020, 4), (0.020, 1), (0.020, 4)):
        step(g, clock, s, width=w)
    assert g.times["offload"] > g.times["hybrid"]
    assert g.choice == "offload" and g.widths == [1, 4]
    assert g.compared == pytest.approx({"hybrid": 0.0175, "offload": 0.01725, "cpu": 0.020})


def test_no_width_in_common_compares_overall_means(clock: Clock) -> None:
    g = _guard(("hybrid", "offload", "cpu"), window=2)
    for s, w in ((0.010, 1), (0.010, 1), (0.008, 2), (0.008, 2), (0.012, 1), (0.012, 1)):
        step(g, clock, s, width=w)
    assert g.settled and g.widths == [] and g.choice == "offload"


def test_listeners_fire_at_every_phase_change(clock: Clock) -> None:
    """Each change of phase (to the next candidate, then to the one kept) calls every
    listener once, after the rule `num_fetch` follows has changed: a captured layer's device
    table is rewritten from it (test_decode_runner checks the tables themselves)."""
    g = _guard(("cpu", "hybrid", "offload"), window=3)
    assert g.num_fetch(6) == 0  # the profile's choice runs first
    seen: list[tuple[str, int]] = []
    g.listeners.append(lambda: seen.append((g.phase, g.num_fetch(6))))
    drive(g, clock, lambda i, running: {"cpu": 0.02, "hybrid": 0.01, "offload": 0.03}[running])
    assert seen == [("hybrid", 3), ("offload", -1), ("settled", 3)]


def test_warm_and_capturing_steps_stay_untimed(clock: Clock) -> None:
    """The first `discard` steps of every width in every phase, and a step that captured a
    graph, are not timed: a 1 s step among them changes nothing."""
    g = _guard(("hybrid", "offload", "cpu"), window=2, discard=2)
    step(g, clock, 1.0)
    step(g, clock, 1.0)  # width 1's two warm steps
    step(g, clock, 1.0, width=3)  # a new width warms too
    g.on_step(True, 1)
    g.discard_step()  # the runner captured a graph in this step
    clock.sleep(1.0)
    g.end_step()
    assert g.steps == 0 and g.discarded == 4 and g.by_width["hybrid"] == {}
    step(g, clock, 0.005)
    step(g, clock, 0.005)
    assert g.phase == "offload" and g.times["hybrid"] == pytest.approx(0.005)
    assert g.by_width["hybrid"] == {1: [pytest.approx(0.010), 2]}
    step(g, clock, 1.0)  # offload's own warm steps: the count starts again per phase
    step(g, clock, 1.0)
    assert g.steps == 0 and g.discarded == 6


def test_idle_time_and_prefill_steps_are_not_counted(clock: Clock) -> None:
    """Bug caught (session 4): the guard timed the wall clock from one step's start to the
    next, so an idle server between requests was charged to the phase being timed. Prefill
    steps never count either."""
    g = _guard(("hybrid", "offload", "cpu"), window=3)
    for _ in range(3):  # the choice: fast steps, long idle gaps and a prefill between them
        step(g, clock, 0.001)
        clock.sleep(0.05)
        g.on_step(decode=False, width=64)
        clock.sleep(0.5)
        g.end_step()
    drive(g, clock, lambda i, running: 0.002)
    assert g.choice == "hybrid" and g.compared["hybrid"] == pytest.approx(0.001)


def test_the_settled_line_names_every_candidate(clock: Clock, caplog) -> None:
    g = _guard(("cpu", "offload", "hybrid"))
    with caplog.at_level(logging.INFO, logger="ft.experts"):
        drive(g, clock, lambda i, running: {"cpu": 0.016, "offload": 0.013,
                                            "hybrid": 0.006}[running])
    lines = [r.message for r in caplog.records if r.message.startswith("auto_settled")]
    assert lines == [("auto_settled chosen=hybrid profile_choice=cpu cpu_ms=16.00 "
                      "offload_ms=13.00 hybrid_ms=6.00 margin_pct=116.7 widths=1 steps=12 "
                      "discarded=0 turn=4")]
    assert g.summary() == {"phase": "settled", "running": "hybrid",
                           "candidates": ["cpu", "offload", "hybrid"],
                           "ms_per_step": {"cpu": 16.0, "offload": 13.0, "hybrid": 6.0},
                           "settled_after_steps": 12}


def test_candidate_rules_choice_first_and_hybrid_only_with_a_q_rule() -> None:
    q = FixedRule(2)
    assert list(candidate_rules("cpu", q)) == ["cpu", "offload", "hybrid"]
    assert list(candidate_rules("hybrid", q)) == ["hybrid", "offload", "cpu"]
    assert candidate_rules("hybrid", q)["hybrid"] is q
    assert list(candidate_rules("offload", None)) == ["offload", "cpu"]
    assert [r(5) for r in candidate_rules("offload", None).values()] == [-1, 0]
    with pytest.raises(ValueError, match="cannot run"):
        candidate_rules("hybrid", None)


def test_a_single_candidate_is_settled_from_the_start() -> None:
    g = AutoGuard({"offload": RULES["offload"]})
    assert g.settled and g.choice == "offload" and g.num_fetch(3) == -1


@pytest.mark.parametrize("b_p,want", [(50.0, ["hybrid", "offload", "cpu"]),
                                      (None, ["cpu", "offload"]), ("none", ["offload", "cpu"])])
def test_runtime_builds_the_candidates_the_layer_can_run(tiny_hf, monkeypatch, b_p,
                                                         want) -> None:
    """A measured profile: hybrid (its choice here) first, then offload and cpu. A profile
    without a GPU measurement (no B_P): the cost model says cpu, and hybrid, whose q* needs
    B_P, is left out. No profile at all: offload first, cpu, no hybrid."""
    from freetoken.cli.build import load_with_experts
    from freetoken.experts.cost_model import BandwidthProfile
    from freetoken.types.config import MoEConfig

    prof = None if b_p == "none" else BandwidthProfile(
        key={}, b_h=60.0, b_p=b_p, b_p_overlap=45.0 if b_p else None,
        b_h_overlap=50.0 if b_p else None, expert_bytes=2**20)
    monkeypatch.setattr("freetoken.experts.runtime.find_profile", lambda model, dtype: prof)
    _, rt = load_with_experts(tiny_hf("qwen3_5_moe"), MoEConfig(backend="auto", cache_size=5),
                              dtype=torch.float32, progress=False)
    assert rt.guard is not None and rt.guard.order == want
    if "hybrid" in want:
        assert rt.guard.rules["hybrid"] is rt.q_rule
    assert rt.stats()["auto"]["phase"] == want[0] and rt.stats()["auto"]["running"] == want[0]


def test_a_dropped_bridge_times_every_candidate_again(clock: Clock) -> None:
    """The CPU bridge dropped mid-timing (its worker failed): cpu and hybrid now run their CPU
    share eagerly, so what was timed before is not comparable. The guard starts over from the
    profile's choice, fires its listeners (the device fetch tables follow), and settles on
    the timings taken after the drop only."""
    g = _guard(("hybrid", "offload", "cpu"), window=4)
    changes: list[str] = []
    g.listeners.append(lambda: changes.append(g.running))
    for _ in range(4):  # hybrid timed fast on the bridge
        step(g, clock, 0.005)
    for _ in range(2):
        step(g, clock, 0.012)  # offload half timed
    assert g.running == "offload"
    g.retime("bridge_dropped")
    assert (g.running, g.times, g.retimed, changes[-1]) == ("hybrid", {}, 1, "hybrid")
    after = {"hybrid": 0.020, "offload": 0.012, "cpu": 0.030}  # eager CPU share: slow
    drive(g, clock, lambda i, running: after[running])
    assert g.choice == "offload" and g.compared == pytest.approx(after)
    g.retime("bridge_dropped")  # also once settled: the paths changed all the same
    assert not g.settled and g.running == "hybrid" and g.retimed == 2


def test_the_runtime_retimes_auto_when_its_bridge_is_dropped() -> None:
    """MoERuntime.drop_bridge tells the guard (the engine drops a failed bridge there)."""
    from freetoken.experts.runtime import MoERuntime

    calls: list[str] = []

    class _Guard:
        def retime(self, why: str) -> None:
            calls.append(why)

    class _Bridge:
        def close(self) -> None:
            calls.append("closed")

    rt = MoERuntime.__new__(MoERuntime)
    rt._bridges, rt.guard = [], _Guard()
    br = _Bridge()
    rt._bridges.append(br)
    MoERuntime.drop_bridge(rt, br)
    assert calls == ["closed", "bridge_dropped"] and rt._bridges == []


def test_the_prefill_stream_follows_what_auto_settles_on(tiny_hf, monkeypatch,
                                                         clock: Clock) -> None:
    """The profile says cpu (its stream then seeds nothing and has cpu's threshold); the live
    timing keeps hybrid: the stream is planned again for hybrid (seeding the cache, hybrid's
    threshold), as `stream_plan` gives for it."""
    from freetoken.cli.build import load_with_experts
    from freetoken.experts.cost_model import BandwidthProfile
    from freetoken.experts.runtime_setup import stream_plan
    from freetoken.types.config import MoEConfig

    prof = BandwidthProfile(key={}, b_h=400.0, b_p=20.0, b_p_overlap=20.0, b_h_overlap=5.0,
                            expert_bytes=2**20)
    monkeypatch.setattr("freetoken.experts.runtime.find_profile", lambda model, dtype: prof)
    cfg = MoEConfig(backend="auto", cache_size=5)
    _, rt = load_with_experts(tiny_hf("qwen3_5_moe"), cfg, dtype=torch.float32, progress=False)
    g, st = rt.guard, rt.streamer
    assert g is not None and g.order[0] == "cpu" and st.seed is False
    want = {b: stream_plan(cfg, b, rt.cache, rt.store, prof, rt.top_k)[0]
            for b in ("cpu", "hybrid")}
    assert st.threshold == want["cpu"] != want["hybrid"], want
    cost = {"cpu": 0.03, "offload": 0.02, "hybrid": 0.01}
    drive(g, clock, lambda i, running: cost[running])
    assert g.choice == "hybrid" and st.seed is True and st.threshold == want["hybrid"]


def _warming_cost(base: dict[str, float]):
    """Step i's seconds under `running`: its steady cost plus a warm-up every candidate meets
    alike, 4 ms at step 0 falling linearly to 0 at step 80 (the expert cache filling toward
    the decode's hot set)."""
    return lambda i, running: base[running] + 0.004 * max(0.0, 1 - i / 80)


def test_turns_cancel_a_warm_up_that_favours_the_last_candidate(clock: Clock) -> None:
    """Session 19 on the H200 (replayed router, batch 4): timed one after the other, the last
    candidate met the warmest cache and won although offload was the faster in steady state.
    Here offload's steady 4.0 ms beats hybrid's 5.2: a whole window each (turn = window)
    keeps hybrid, the serpentine turns keep offload, and charge every candidate about the
    same share of the warm-up."""
    base = {"cpu": 0.010, "offload": 0.0040, "hybrid": 0.0052}
    seq = _guard(("cpu", "offload", "hybrid"), window=32, discard=2)
    seq.turn = 32
    drive(seq, clock, _warming_cost(base))
    assert seq.choice == "hybrid"  # the bias this guards against
    g = AutoGuard({n: RULES[n] for n in ("cpu", "offload", "hybrid")}, window=32, discard=2,
                  turn=8)
    ran = drive(g, clock, _warming_cost(base))
    assert g.choice == "offload"
    # serpentine: cpu offload hybrid | hybrid offload cpu | ... in turns of 8 timed steps
    # (each candidate's first turn also runs its 2 untimed warm steps)
    turns = [k for k, _ in itertools.groupby(ran)]
    assert turns == ["cpu", "offload", "hybrid", "offload", "cpu", "offload", "hybrid",
                     "offload", "cpu"]
    assert all(ran.count(n) == 34 for n in base) and g.settled_after == len(ran) == 102
    # the warm-up each candidate was charged: spread over 3 ms timed a window each, under
    # 0.3 ms in turns (exact for a linear drift; this one stops falling at step 80)
    def spread(guard):
        warm = [guard.compared[n] - base[n] for n in base]
        return max(warm) - min(warm)
    assert spread(seq) > 3e-3 and spread(g) < 3e-4


def test_turns_fire_listeners_only_when_the_candidate_changes(clock: Clock) -> None:
    """At a serpentine round's end the same candidate runs on: no listener call (a captured
    layer rewrites its device table only when the rule changes)."""
    g = AutoGuard({n: RULES[n] for n in ("hybrid", "offload")}, window=4, discard=0, turn=2)
    seen: list[str] = []
    g.listeners.append(lambda: seen.append(g.phase))
    ran = drive(g, clock, lambda i, running: {"hybrid": 0.01, "offload": 0.02}[running])
    assert ran == ["hybrid"] * 2 + ["offload"] * 4 + ["hybrid"] * 2
    assert seen == ["offload", "hybrid", "settled"] and g.choice == "hybrid"


def test_bad_window_or_turn_is_refused() -> None:
    with pytest.raises(ValueError, match="window and turn"):
        AutoGuard({"offload": RULES["offload"]}, window=0)
    with pytest.raises(ValueError, match="window and turn"):
        AutoGuard({"offload": RULES["offload"]}, turn=0)
