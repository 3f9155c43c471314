"""q* and the backend choice (experts/cost_model.py) against hand computations (DESIGN §4)."""
from __future__ import annotations

import pytest

from freetoken.experts.cost_model import (
    BandwidthProfile,
    expected_misses,
    hybrid_time,
    predicted_step_time,
    q_star,
    q_star_overlapped,
    recommend_backend,
)


@pytest.mark.parametrize(
    ("m", "b_p", "b_h", "max_fetch", "want"),
    [
        (8, 48, 80, None, 5),  # 8 * 48 / 80 = 4.8
        (1, 48, 80, None, 1),  # 0.6
        (1, 10, 80, None, 1),  # 0.125 rounds to 0, but one fill is kept
        (16, 55, 88, None, 10),  # 10.0
        (5, 1, 2, None, 3),  # 2.5 rounds half up
        (3, 50, 40, None, 3),  # CPU no faster than the link: fetch everything
        (8, 48, 80, 2, 2),  # capped by --moe-hybrid-max-fetch
        (8, 48, 80, 0, 0),  # fetching forbidden
        (0, 48, 80, None, 0),
    ],
)
def test_q_star(m: int, b_p: float, b_h: float, max_fetch: int | None, want: int) -> None:
    assert q_star(m, b_p, b_h, max_fetch) == want


def test_q_star_overlapped() -> None:
    assert q_star_overlapped(8, 45, 30) == 5  # 8 * 45 / 75 = 4.8
    assert q_star_overlapped(8, 40, 45) == 4  # 3.76
    assert q_star_overlapped(1, 5, 95) == 1  # 0.05, at least one


def test_hybrid_time_linear_model() -> None:
    # Link-bound: fetch 5/48 s; CPU 3 bytes at 80-48=32 -> 0.09375 s, inside the fetch window.
    assert hybrid_time(8, 5, 1.0, 48, 80) == pytest.approx(5 / 48)
    # CPU-bound: 2/48 s of fetch (CPU moves 32*2/48 = 4/3 bytes), then 14/3 bytes at 80.
    assert hybrid_time(8, 2, 1.0, 48, 80) == pytest.approx(2 / 48 + (6 - 4 / 3) / 80)
    # The balance point q* = m B_P / B_H gives m S / B_H exactly.
    assert hybrid_time(10, 6, 1.0, 48, 80) == pytest.approx(10 / 80)


def _prof(**kw: float | None) -> BandwidthProfile:
    base: dict = {"key": {"gpu": "g"}, "b_h": 50.0, "b_p": 48.0, "expert_bytes": 10**9}
    base.update(kw)
    return BandwidthProfile(**base)


def test_predicted_step_time() -> None:
    p = _prof()
    assert predicted_step_time("offload", 8, p) == pytest.approx(8 / 48)
    assert predicted_step_time("cpu", 8, p) == pytest.approx(8 / 50)
    po = _prof(b_p_overlap=45.0, b_h_overlap=30.0)
    assert predicted_step_time("hybrid", 8, po) == pytest.approx(max(5 / 45, 3 / 30))
    with pytest.raises(ValueError):
        predicted_step_time("offload", 8, _prof(b_p=None))
    with pytest.raises(ValueError):
        predicted_step_time("fused", 8, p)


def test_recommend_backend() -> None:
    assert expected_misses(8, 0.37) == 5  # 8 * 0.63 = 5.04
    assert expected_misses(8, 0.99) == 1
    assert expected_misses(8, 1.0) == 0
    po = _prof(b_p_overlap=45.0, b_h_overlap=30.0)
    # m=8: offload 0.167, cpu 0.16, hybrid max(5/45, 3/30)=0.111
    assert recommend_backend(po, 0.0) == "hybrid"
    # m=1: offload 1/48, cpu 1/50, hybrid (q=1) 1/45
    assert recommend_backend(po, 0.9) == "cpu"
    # A slow CPU: offload wins (hybrid would equal it at q=m; ties go to the simpler one).
    assert recommend_backend(_prof(b_h=10.0), 0.0) == "offload"
    assert recommend_backend(_prof(b_p=None), 0.0) == "cpu"
    assert recommend_backend(po, 1.0) == "offload"
