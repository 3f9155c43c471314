"""The PCIe receive meter of `ft bench decode` (bench/link_meter.py) and the checks it and the
expert counts feed (cli_decode.byte_checks, count_checks). Oracles: the exact integral of a rate
that is linear between known points, and rows built so that each check must (or must not) fire.
Bug it would catch: a meter that drops the window's ends, counts an interval twice, or keeps
samples of an earlier window; a check that blames the counters when the driver agrees with them;
a row whose steps "route" more experts than they can (issue 20 item 3) passing unflagged."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from freetoken.bench.cli_decode import byte_checks, count_checks
from freetoken.bench.link_meter import LinkMeter, integrate, nvml_rx_reader
from freetoken.bench.moe import RunResult


def test_integrate_is_exact_on_piecewise_linear_rates() -> None:
    assert integrate([]) == 0.0 and integrate([(1.0, 5.0)]) == 0.0
    # 0 -> 10 B/s over 2 s, then flat 10 B/s for 3 s: 10 + 30 bytes
    assert integrate([(0.0, 0.0), (1.0, 5.0), (2.0, 10.0), (5.0, 10.0)]) == pytest.approx(40.0)
    assert integrate([(0.0, 3.0), (0.0, 100.0), (1.0, 100.0)]) == pytest.approx(100.0)


def test_meter_integrates_the_window_it_was_started_for() -> None:
    """A stepped clock the sampler thread advances: each sample moves time 0.5 s on; the rate
    is 2 t GB/s, so any window [a, b] must read exactly b^2 - a^2 GB (trapezoids are exact)."""
    lock = threading.Lock()
    now = [0.0]

    def clock() -> float:
        with lock:
            now[0] += 0.5
            return now[0]

    def rate() -> float:
        with lock:
            return 2e9 * now[0]

    m = LinkMeter(rate, period_s=0.001, clock=clock)
    assert m.available and m.stop() is None  # not started: nothing measured
    for _ in range(2):  # a second window starts afresh
        m.start()
        while len(m.samples) < 20:
            threading.Event().wait(0.001)
        got = m.stop()
        a, b = m.samples[0][0], m.samples[-1][0]
        assert got == pytest.approx((b * b - a * a) * 1e9)
        assert [t for t, _ in m.samples] == sorted(t for t, _ in m.samples)


def test_no_meter_without_nvml() -> None:
    m = LinkMeter(None)
    m.start()
    assert not m.available and m.stop() is None
    try:
        import pynvml  # noqa: F401
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU with NVML: the reader exists here")
    except ImportError:
        pass
    assert nvml_rx_reader(0) is None


def _row(fetch_mb: float, nvml_mb: float | None) -> RunResult:
    return RunResult("offload", 90.0, 0.36, fetch_mb * 1e6, 0.0, None, "",
                     None if nvml_mb is None else nvml_mb * 1e6)


def test_byte_checks_name_the_wrong_side() -> None:
    # issue 20's row: 749.9 MB a step at 90.1 tok/s = 67.6 GB/s over a 55 GB/s link
    link = 749.9e6 * 90.1 / 1e9
    over = byte_checks("offload", _row(749.9, 520.0), link, 55.0)
    assert len(over) == 2 and "exceeds" in over[0] and "over-count" in over[1]
    timing = byte_checks("offload", _row(749.9, 740.0), link, 55.0)
    assert len(timing) == 2 and "step time is what is wrong" in timing[1]
    assert byte_checks("offload", _row(600.0, 640.0), 600e6 * 90 / 1e9, 55.0) == []
    assert byte_checks("offload", _row(600.0, None), 600e6 * 90 / 1e9, 55.0) == []
    # counters above the driver's figure are wrong even when the rate is plausible
    low = byte_checks("offload", _row(400.0, 200.0), 400e6 * 90 / 1e9, 55.0)
    assert len(low) == 1 and "over-count" in low[0]


def test_count_checks_flag_counts_no_step_can_have() -> None:
    """The H200's offload row of issue 20 item 3 (hit 0.361, 143.3 experts fetched a step at
    160 routed a step): the counters had taken in the 51 graph replays timed after 127 steps,
    so a step "routed" 224.3 experts, more than its 20 layers x top-8 can."""
    def row(routed: float, misses: float, fetched: float) -> RunResult:
        return replace(_row(fetched * 6.29, None), routed_tok=routed, misses_tok=misses,
                       fetched_tok=fetched, route_bound=160)

    h200 = count_checks("offload", row(224.3, 143.3, 143.3))
    assert len(h200) == 1 and "224.3" in h200[0] and "outside the timed window" in h200[0]
    assert count_checks("offload", row(160.0, 102.2, 102.2)) == []  # the same run, fixed
    assert count_checks("hybrid", row(160.0, 102.2, 40.0)) == []  # the CPU took the rest
    twice = count_checks("offload", row(160.0, 102.2, 110.0))
    assert len(twice) == 1 and "fetch counter is wrong" in twice[0]
    assert count_checks("fused", RunResult("fused", 500.0, 0.0, 0.0, 0.0, None)) == []
