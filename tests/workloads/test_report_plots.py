"""The workload plots' structure (#23 item 7): one panel per workload with its own y axis and
integer turn ticks, main and sub-agent turns as separate series, failed turns marked, and a
cache panel whose "new tokens" band tells a cache miss from new tool output. Bug caught: one
shared axis across workloads with fractional ticks, main and sub-agent turns joined into one
line, failed turns as silent gaps."""
from __future__ import annotations

from pathlib import Path

import matplotlib.figure
import pytest
from matplotlib.ticker import MaxNLocator

from workloads import report
from workloads.client import TurnResult
from workloads.runner import WorkloadResult


def _turn(i: int, group: str, session: str, error: str | None = None) -> TurnResult:
    t = TurnResult(f"T{i}", session, group, 8, start=float(i), prompt_tokens=100 + 40 * i,
                   cached_tokens=90 + 30 * i, output_tokens=8, error=error)
    if error is None:
        t.first_token, t.last_token, t.end = i + 0.5, i + 1.2, i + 1.3
    return t


@pytest.fixture
def figures(monkeypatch) -> list[matplotlib.figure.Figure]:
    saved: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: saved.append(self))
    return saved


def _results() -> dict[str, WorkloadResult]:
    w1 = WorkloadResult("W1", "v", "openai", "x")
    w1.turns = [_turn(1, "main", "m"), _turn(2, "main", "m")]
    w3 = WorkloadResult("W3", "v", "openai", "x")
    w3.turns = [_turn(1, "main", "m"), _turn(2, "fanout", "k1"), _turn(3, "fanout", "k2"),
                _turn(4, "main", "m", error="HTTP 400"), _turn(5, "main", "m")]
    return {"W1": w1, "W3": w3}


def test_per_turn_panels_series_and_failures(figures, tmp_path: Path) -> None:
    report._per_turn(_results(), "decode_tps", "decode tok/s", tmp_path / "x.png")
    (fig,) = figures
    w1, w3 = fig.axes
    assert (w1.get_title(), w3.get_title()) == ("W1", "W3")
    assert w1.get_shared_y_axes().get_siblings(w1) == [w1]  # own y axis per workload
    for ax in fig.axes:
        loc = ax.xaxis.get_major_locator()
        assert isinstance(loc, MaxNLocator) and loc._integer
    lines = {ln.get_label(): ln for ln in w3.get_lines()}
    assert set(lines) == {"main", "sub-agents", "failed"}
    assert list(lines["main"].get_xdata()) == [1, 5]  # turn 4 failed: no point, no join
    assert list(lines["sub-agents"].get_xdata()) == [2, 3]
    assert list(lines["failed"].get_xdata()) == [4]
    assert "failed" not in {ln.get_label() for ln in w1.get_lines()}


def test_cache_panel_splits_new_tokens_from_misses(figures, tmp_path: Path) -> None:
    res = _results()
    report._cache(res, tmp_path / "c.png")
    (fig,) = figures
    ax = fig.axes[1]
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    new = report.new_tokens(res["W3"])
    rec = [t.recomputed_tokens for t in res["W3"].turns]
    assert bars["new tokens"] == [min(n, r) for n, r in zip(new, rec)]
    assert bars["cache miss"] == [r - min(n, r) for n, r in zip(new, rec)]
    assert bars["cached"] == [t.cached_tokens for t in res["W3"].turns]
    assert [ln.get_label() for ln in ax.get_lines()] == ["failed"]
