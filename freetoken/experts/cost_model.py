"""The decode equation (DESIGN §4): how many misses to fetch, and which backend to run.

Per layer and step, `m` routed experts miss the GPU cache; each is `S` bytes. Fetching one moves
S bytes over the link at B_P (pinned host-to-device); computing one on the CPU reads S bytes of
host memory at B_H. A saturated link itself reads host memory at B_P, leaving the CPU B_H - B_P,
so fetching q and computing m - q balances at
    q * S / B_P = (m - q) * S / (B_H - B_P)   =>   q* = m * B_P / B_H,   time m * S / B_H.
When the overlapped pair (B_P', B_H') was measured (both running at once), the balance is
q * S / B_P' = (m - q) * S / B_H', i.e. q* = m * B_P' / (B_P' + B_H'); it is preferred because
real memory controllers are not linear. All bandwidths are in bytes/s (any one unit works).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("offload", "cpu", "hybrid")


@dataclass(frozen=True)
class BandwidthProfile:
    """Measured bandwidths of one machine for one expert shape and dtype (GB/s).

    b_p: pinned host-to-GPU fill rate in expert-sized copies (None without a GPU).
    b_h: CPU expert kernel rate at batch 1 on fresh (DRAM-resident) experts.
    b_p_overlap / b_h_overlap: the same two while running concurrently (None if not measured).
    host_read / link: ceilings (an all-thread read stream; one large pinned copy).
    cpu_threads: the CPU kernel's thread count behind b_h and b_h_overlap (0: not recorded).
    """

    key: dict[str, str]
    b_h: float
    b_p: float | None = None
    b_p_overlap: float | None = None
    b_h_overlap: float | None = None
    host_read: float | None = None
    link: float | None = None
    expert_bytes: int = 0
    measured_at: str = ""
    cpu_threads: int = 0

    @property
    def has_overlap(self) -> bool:
        return self.b_p_overlap is not None and self.b_h_overlap is not None


def _round_half_up(v: float) -> int:
    return math.floor(v + 0.5)


def q_star(m: int, b_p: float, b_h: float, max_fetch: int | None = None) -> int:
    """Misses to fetch out of `m` (the rest run on the CPU): round(m * B_P / B_H), at least one
    when m >= 1, at most m and at most `max_fetch` (--moe-hybrid-max-fetch; 0 forbids fetching).
    A CPU no faster than the link (B_H <= B_P) gets nothing: q = m."""
    if m <= 0:
        return 0
    q = m if b_h <= b_p else _round_half_up(m * b_p / b_h)
    q = min(m, max(1, q))
    if max_fetch is not None:
        q = min(q, max(0, max_fetch))
    return q


def q_star_overlapped(m: int, b_p_overlap: float, b_h_overlap: float,
                      max_fetch: int | None = None) -> int:
    """q* from the measured concurrent pair: round(m * B_P' / (B_P' + B_H')), same clamps."""
    if m <= 0:
        return 0
    q = min(m, max(1, _round_half_up(m * b_p_overlap / (b_p_overlap + b_h_overlap))))
    if max_fetch is not None:
        q = min(q, max(0, max_fetch))
    return q


def offload_time(m: int, expert_bytes: float, b_p: float) -> float:
    """Seconds to fetch all m misses: m * S / B_P."""
    return m * expert_bytes / b_p


def cpu_time(m: int, expert_bytes: float, b_h: float) -> float:
    """Seconds to compute all m misses on the CPU: m * S / B_H."""
    return m * expert_bytes / b_h


def hybrid_time(m: int, q: int, expert_bytes: float, b_p: float, b_h: float) -> float:
    """Seconds for q fetches and m - q CPU experts started together, linear model: while the
    link runs the CPU gets B_H - B_P of host bandwidth, afterwards all of B_H."""
    t_fetch = q * expert_bytes / b_p
    cpu_bytes = (m - q) * expert_bytes
    shared = max(b_h - b_p, 0.0)
    if cpu_bytes <= shared * t_fetch:
        t_cpu = cpu_bytes / shared if shared > 0 else 0.0
    else:
        t_cpu = t_fetch + (cpu_bytes - shared * t_fetch) / b_h
    return max(t_fetch, t_cpu)


def hybrid_time_overlapped(m: int, q: int, expert_bytes: float, b_p_overlap: float,
                           b_h_overlap: float) -> float:
    """Seconds for the split using the measured concurrent rates: max of the two branches."""
    return max(q * expert_bytes / b_p_overlap, (m - q) * expert_bytes / b_h_overlap)


def predicted_step_time(backend: str, m: int, profile: BandwidthProfile,
                        max_fetch: int | None = None) -> float:
    """Seconds one layer spends on `m` misses under `backend`, from the profile (GB/s)."""
    s = float(profile.expert_bytes)
    gb = 1e9
    if backend == "cpu":
        return cpu_time(m, s, profile.b_h * gb)
    if profile.b_p is None:
        raise ValueError(f"backend {backend!r} needs B_P; the profile has no GPU measurement")
    if backend == "offload":
        return offload_time(m, s, profile.b_p * gb)
    if backend == "hybrid":
        if profile.has_overlap:
            assert profile.b_p_overlap is not None and profile.b_h_overlap is not None
            q = q_star_overlapped(m, profile.b_p_overlap, profile.b_h_overlap, max_fetch)
            return hybrid_time_overlapped(m, q, s, profile.b_p_overlap * gb,
                                          profile.b_h_overlap * gb)
        q = q_star(m, profile.b_p, profile.b_h, max_fetch)
        return hybrid_time(m, q, s, profile.b_p * gb, profile.b_h * gb)
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def expected_misses(top_k: int, cache_rate: float) -> int:
    """Misses per layer at batch 1 when a fraction `cache_rate` of routed experts hit."""
    if cache_rate >= 1.0:
        return 0
    return max(1, _round_half_up(top_k * (1.0 - max(cache_rate, 0.0))))


def recommend_backend(profile: BandwidthProfile, cache_rate: float, top_k: int = 8) -> str:
    """The fastest of offload / cpu / hybrid by the predicted time of a batch-1 layer with
    `top_k` routed experts of which `cache_rate` hit. Ties go to the simpler backend (the order
    of BACKENDS); without a GPU measurement the answer is cpu; with no misses, offload."""
    if profile.b_p is None:
        return "cpu"
    m = expected_misses(top_k, cache_rate)
    if m == 0:
        return "offload"
    times = {b: predicted_step_time(b, m, profile) for b in BACKENDS}
    best = min(times.values())
    return next(b for b in BACKENDS if times[b] <= best * (1 + 1e-9))
