"""B_H from the native loop's steps as the slope of time against bytes (experts/bw_track.py
`CostFit`), not bytes over time. Bug caught (H200, replayed trained-router routing at a 0.91
hit rate): a few CPU experts a step, so each step's fixed cost dominated its time; bytes over
time read B_H 87 -> 5.9 GB/s and q* moved 3 -> 7 of 8 misses fetched, while uniform routing's
large steps read 124 GB/s on the same machine. Oracle: the bandwidth and fixed cost the
samples are drawn from, and `cost_model.q_star` at that bandwidth."""
from __future__ import annotations

import random

import torch

from freetoken.experts.bw_track import BandwidthEstimate, CostFit, Reprofiler
from freetoken.experts.cost_model import q_star
from freetoken.experts.split import QStarRule

EXPERT = 6_291_456  # one Qwen3.6-35B-A3B expert in bf16
C0, GBPS = 2e-3, 80.0  # a step's fixed cost, the host's marginal bandwidth


def _steps(n: int, rng: random.Random, lo: int = 1, hi: int = 12, noise: float = 0.05):
    """Native-loop steps of lo..hi CPU experts: time = C0 + bytes / GBPS, +- noise."""
    for _ in range(n):
        nbytes = rng.randint(lo, hi) * EXPERT
        yield nbytes, (C0 + nbytes / (GBPS * 1e9)) * (1 + rng.uniform(-noise, noise))


def test_fit_recovers_bandwidth_and_fixed_cost_where_the_ratio_cannot() -> None:
    rng = random.Random(0)
    fit, ratio = CostFit(), BandwidthEstimate("b_h", 80.0, min_bytes=0)
    for s in _steps(400, rng):
        fit.add(*s)
        ratio.observe(*s)
    assert fit.valid
    assert abs(fit.gbps / GBPS - 1) < 0.08, fit.gbps
    assert abs(fit.c0_s / C0 - 1) < 0.15, fit.c0_s
    assert ratio.gbps < GBPS / 2  # bytes over time: the fixed cost read as a slow host


def test_fit_is_not_trusted_without_spread_or_when_unphysical() -> None:
    rng = random.Random(1)
    narrow = CostFit()
    for s in _steps(200, rng, lo=10, hi=11):  # sizes within 10 %: slope and c0 inseparable
        narrow.add(*s)
    assert not narrow.valid and narrow.gbps is None
    few = CostFit()
    for s in _steps(8, rng):
        few.add(*s)
    assert not few.valid  # under min_samples
    neg = CostFit()  # time shrinking as bytes grow (a clock gone wrong): no slope to trust
    for k in range(1, 40):
        neg.add(k * EXPERT, 1.0 / k)
    assert not neg.valid


def test_fit_forgets_an_old_regime() -> None:
    """A host slowed to a quarter (another job on the cores) is what the fit reads after a few
    hundred steps: the forgetting weighs the recent steps."""
    rng = random.Random(2)
    fit = CostFit()
    for s in _steps(300, rng):
        fit.add(*s)
    for n, t in _steps(600, rng):
        fit.add(n, t + 3 * n / (GBPS * 1e9))  # the marginal cost x 4
    assert abs(fit.gbps / (GBPS / 4) - 1) < 0.1, fit.gbps


class _Layer:  # what Reprofiler._refresh_tables reads of a CpuSplitExperts
    store = type("S", (), {"num_experts": 8})()

    def __init__(self, rule):
        self.rule = rule
        self._fetch_table = torch.tensor(rule.table(8))


def test_native_steps_set_the_rule_from_the_slope_python_calls_from_the_ratio() -> None:
    """The same samples as whole native steps move the rule to the marginal bandwidth (q* as
    at 80 GB/s); as single Python-branch calls (whose fixed cost fetching every miss avoids)
    they keep bytes over time, the slower figure."""
    for per_step, want in ((True, GBPS), (False, None)):
        rng = random.Random(3)
        rule = QStarRule(25.0, 200.0, overlap=False)
        layer = _Layer(rule)
        rp = Reprofiler(rule, [layer], every_steps=8, drift=0.0)
        for _ in range(60):
            for s in _steps(8, rng):
                rp.host_sample(*s, per_step=per_step)
            rp.at_safe_point()
        if want is not None:
            assert abs(rule.b_h / want - 1) < 0.1, rule.b_h
            assert rule(8) == q_star(8, 25.0, rule.b_h)
            assert layer._fetch_table.tolist() == rule.table(8)
            st = rp.stats()
            assert st["b_h_fit"] == round(rule.b_h, 3)
            assert abs(st["step_c0_us"] / (C0 * 1e6) - 1) < 0.2
        else:
            assert rule.b_h < GBPS / 2 and rp.stats()["b_h_fit"] is None
