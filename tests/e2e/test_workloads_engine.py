"""`ft bench workload` against our real engine at tiny scale: every turn completes with the
recorded output length, cached tokens grow turn over turn within W2–W4 sessions, W3's sibling
sub-agents overlap in time, and the report with its plots is written."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from workloads import build_workload, run_workload, write_report


@pytest.fixture(scope="module")
def results(live):
    server, _ = live
    return {name: run_workload(build_workload(name, scale="tiny"), server.url)
            for name in ("W1", "W2", "W3", "W4")}


def test_every_turn_completes_with_recorded_length(results) -> None:
    for name, res in results.items():
        assert res.ok, (name, [t.error for t in res.turns if t.error])
        for t in res.turns:
            assert t.output_tokens == t.expected_output_tokens, (name, t.turn_id)


def test_cached_tokens_grow_within_sessions(results) -> None:
    for name in ("W2", "W3", "W4"):
        by_session: dict[str, list] = {}
        for t in sorted(results[name].turns, key=lambda t: t.start):
            by_session.setdefault(t.session, []).append(t)
        grew = 0
        for turns in by_session.values():
            cached = [t.cached_tokens or 0 for t in turns]
            grew += sum(1 for a, b in itertools.pairwise(cached) if b > a)
            assert cached[-1] > 0 or len(turns) == 1, (name, cached)
        assert grew >= 1, name


def test_w3_siblings_overlap(results) -> None:
    w3 = {t.turn_id: t for t in results["W3"].turns}
    s1, s2 = w3["S1.1"], w3["S2.1"]  # the two sub-agents' first requests, fanned out together
    assert s2.start < s1.end and s1.start < s2.end
    assert w3["M4"].start >= max(w3["S1.5"].end, w3["S2.5"].end)  # the parent waited for both


def test_report_written(results, tmp_path: Path) -> None:
    report = write_report(results, tmp_path)
    assert report.exists() and "W4" in report.read_text()
    for png in ("decode_rate.png", "ttft.png", "cache.png"):
        assert (tmp_path / png).stat().st_size > 1000
