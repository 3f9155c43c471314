"""Bandwidth re-profiling from the engine's own traffic: B_P and B_H drift on a shared machine.

The profile (`ft bench bw`, experts/calibrate.py) is measured once; afterwards another process
on the PCIe link or on the cores moves the real figures, and q* (experts/split.py's split of a
layer's misses between fetches and the CPU) goes stale. `Reprofiler` re-measures them for free
from what serving already does:

- B_H: every CPU expert-branch call, its expert bytes (distinct experts computed x bytes per
  expert) over its wall time (`host_sample`): per layer from the synced path and the bridge's
  Python worker (`timed_branch`), per step from the bridge's native loop (`native_sampler`:
  the experts the C++ step loop computed over the loop's time less its waits for the GPU);
- B_P: every eager slot fill, its bytes over its time (`link_begin`/`link_end`: CUDA events,
  read at the next safe point, so nothing syncs; wall time on the CPU device).

Each channel is a `BandwidthEstimate`: an EWMA in log space with outlier rejection (a sample
further than `reject` x the running mean absolute deviation from the estimate is dropped,
unless `shift_after` samples in a row lie on the same side: a real change of regime, taken).

A call's time is not bytes / bandwidth alone: every CPU-branch step pays a fixed cost (the
thread team's wake-up and per-layer hand-offs; a team member the OS preempted) and every fill a
launch. Where calls are small, bytes over time measures that fixed cost, not the bandwidth (H200,
replayed routing at a 0.91 hit rate: a few experts a step, B_H read 87 -> 5.9 GB/s and q* went
3 -> 7 of 8 fetched, while uniform routing's large steps read 124 GB/s on the same machine).
So the native loop's per-step samples also feed a `CostFit`: seconds = c0 + bytes / B_H by
exponentially weighted least squares; where the steps' sizes spread enough to tell the two apart
(`CostFit.valid`), B_H is the fit's slope and c0 is reported beside it, otherwise the EWMA's
figure. The slope is what the split needs there: the step's fixed cost is paid whatever q is
(the loop runs every layer, and the GPU waits for each layer's hand-back, CPU work or none), so
only the marginal cost of one more expert on either side moves the balance. A Python-branch
sample is one layer's call, whose fixed cost fetching every miss does avoid: those keep the
EWMA of bytes over time.
At safe points (`at_safe_point`, every `every_steps` engine steps) an estimate that moved more
than `drift` from the rule's figure is written into the rule (`QStarRule.b_p/b_h`), the
device-side fetch tables that captured steps read are rewritten in place (no re-capture), and
one `bw_reprofile` line is logged. Samples measured while fetches and the CPU branch run
concurrently are what the overlapped profile measures (B_P', B_H'), which is what the rule
uses when the profile has the concurrent pair.

Not measured: fills done by the device inside a captured step (offload's UVA fill), which have
no host-visible time; B_P then follows only eager steps (prefill, synced decode).
"""
from __future__ import annotations

import math
import time
from collections import deque

import torch

from freetoken.log import get_logger, kv

log = get_logger("experts")
REPROFILE_EVERY_STEPS = 64
DRIFT = 0.10
_MIN_BYTES = 1 << 20  # a sample smaller than this is mostly call overhead, not bandwidth


class BandwidthEstimate:
    """One channel's bandwidth in GB/s: EWMA in log space with outlier rejection (see the
    module docstring). `observe` returns whether the sample was taken."""

    def __init__(self, name: str, prior_gbps: float, alpha: float = 0.2, reject: float = 4.0,
                 shift_after: int = 4, min_bytes: int = _MIN_BYTES, min_dev: float = 0.05):
        self.name, self.gbps = name, float(prior_gbps)
        self.alpha, self.reject, self.shift_after = alpha, reject, shift_after
        self.min_bytes, self.min_dev = min_bytes, min_dev
        self.dev = 0.25  # running mean |log(sample / estimate)|: a loose start
        self.taken = self.rejected = 0
        self._side, self._run = 0, 0  # rejected samples in a row on one side

    def observe(self, nbytes: float, seconds: float) -> bool:
        if nbytes < self.min_bytes or seconds <= 0:
            return False
        r = math.log(nbytes / seconds / 1e9 / self.gbps)
        if self.taken and abs(r) > self.reject * max(self.dev, self.min_dev):
            side = 1 if r > 0 else -1
            self._run = self._run + 1 if side == self._side else 1
            self._side = side
            if self._run < self.shift_after:
                self.rejected += 1
                return False
            self.dev = abs(r)  # a new regime: its spread is not known yet
        self._run = 0
        self.gbps *= math.exp(self.alpha * r)
        self.dev += self.alpha * (abs(r) - self.dev)
        self.taken += 1
        return True


class CostFit:
    """seconds = c0 + bytes / B over a channel's samples, by least squares with exponential
    forgetting (`alpha` per sample: about the last 1/alpha samples count). `valid` once there
    are `min_samples` samples whose sizes spread (coefficient of variation >= `min_cv`) and the
    fit is physical (B > 0, c0 >= -`slack` x the mean time): then `gbps` is B, `c0_s` is c0."""

    def __init__(self, alpha: float = 0.02, min_samples: int = 16, min_cv: float = 0.25,
                 slack: float = 0.05):
        self.alpha, self.min_samples, self.min_cv, self.slack = alpha, min_samples, min_cv, slack
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.n = 0

    def add(self, nbytes: float, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        k = 1.0 - self.alpha
        x = nbytes / 1e9  # GB: the sums stay well inside a double's range
        self.w = self.w * k + 1.0
        self.sx = self.sx * k + x
        self.sy = self.sy * k + seconds
        self.sxx = self.sxx * k + x * x
        self.sxy = self.sxy * k + x * seconds
        self.n += 1

    def _fit(self) -> tuple[float, float] | None:
        """(slope s/GB, intercept s), or None when the sizes do not spread enough."""
        if self.n < self.min_samples or self.w <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        vx = self.sxx / self.w - mx * mx
        if mx <= 0 or vx <= 0 or math.sqrt(vx) / mx < self.min_cv:
            return None
        slope = (self.sxy / self.w - mx * my) / vx
        c0 = my - slope * mx
        if slope <= 0 or c0 < -self.slack * my:
            return None
        return slope, max(c0, 0.0)

    @property
    def valid(self) -> bool:
        return self._fit() is not None

    @property
    def gbps(self) -> float | None:
        f = self._fit()
        return None if f is None else 1.0 / f[0]

    @property
    def c0_s(self) -> float | None:
        f = self._fit()
        return None if f is None else f[1]


class Reprofiler:
    """B_P and B_H re-measured from traffic, written into `rule` (see the module docstring).

    `backends`: the MoE layers whose device fetch tables follow the rule. `host_sample` may be
    called from any thread; everything else runs on the engine thread."""

    def __init__(self, rule, backends: list, every_steps: int = REPROFILE_EVERY_STEPS,
                 drift: float = DRIFT, min_bytes: int = _MIN_BYTES):
        self.rule, self.backends = rule, backends
        self.every_steps, self.drift = every_steps, drift
        self.b_p = BandwidthEstimate("b_p", rule.b_p, min_bytes=min_bytes)
        self.b_h = BandwidthEstimate("b_h", rule.b_h, min_bytes=min_bytes)
        self.step_fit = CostFit()  # the native loop's per-step samples (B_H)
        self.min_bytes = min_bytes
        self._host: deque[tuple[float, float, bool]] = deque(maxlen=4096)
        self._link: deque[tuple[object, object, float]] = deque(maxlen=4096)
        self.steps = self.updates = 0

    # -- samples -----------------------------------------------------------------------------

    def host_sample(self, nbytes: float, seconds: float, per_step: bool = False) -> None:
        """A CPU expert-branch call: `nbytes` of expert weights computed in `seconds`
        (`per_step`: a whole step of the native loop, every layer, rather than one layer's
        call)."""
        self._host.append((nbytes, seconds, per_step))

    def link_begin(self, device: torch.device) -> object:
        """Before an eager fill: a CUDA event on the current stream, or the wall clock."""
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def link_end(self, start: object, nbytes: float) -> None:
        """After the fill that moved `nbytes` from the host store into slots."""
        if nbytes <= 0:
            return
        if isinstance(start, float):
            self._link.append((start, time.perf_counter(), nbytes))
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._link.append((start, ev, nbytes))

    # -- at safe points ----------------------------------------------------------------------

    def at_safe_point(self) -> dict | None:
        """Count an engine step; every `every_steps` fold the samples in and update the rule
        when an estimate drifted. Returns the update (None: nothing changed)."""
        self.steps += 1
        if self.steps % self.every_steps:
            return None
        return self.fold()

    def fold(self) -> dict | None:
        while self._host:
            n, secs, per_step = self._host.popleft()
            self.b_h.observe(n, secs)
            if per_step and n >= self.min_bytes:  # the fit sees every step: c0 is no outlier
                self.step_fit.add(n, secs)
        while self._link:
            a, b, n = self._link[0]
            if isinstance(a, float):
                secs = b - a
            elif b.query():
                secs = a.elapsed_time(b) / 1e3
            else:  # not run yet: next time (later samples are behind it on the stream)
                break
            self._link.popleft()
            self.b_p.observe(n, secs)
        return self._update()

    def estimate(self, name: str) -> float | None:
        """A channel's bandwidth (GB/s) for the rule: B_H from the native steps' cost fit
        where valid, else the channel's EWMA; None before any sample was taken."""
        if name == "b_h" and self.step_fit.gbps is not None:
            return self.step_fit.gbps
        est = getattr(self, name)
        return est.gbps if est.taken else None

    def _update(self) -> dict | None:
        rule = self.rule
        old_p, old_h = rule.b_p, rule.b_h
        now = {n: self.estimate(n) for n in ("b_p", "b_h")}
        moved = [n for n, old in (("b_p", old_p), ("b_h", old_h))
                 if now[n] is not None and abs(now[n] / old - 1) > self.drift]
        if not moved:
            return None
        q_before = rule(8)
        for n in moved:
            setattr(rule, n, now[n])
        self.updates += 1
        self._refresh_tables()
        out = {"b_p": round(rule.b_p, 2), "b_h": round(rule.b_h, 2), "q8": rule(8)}
        log.info(kv("bw_reprofile", b_p=f"{old_p:.2f}->{rule.b_p:.2f}",
                    b_h=f"{old_h:.2f}->{rule.b_h:.2f}", q_star_of_8=f"{q_before}->{out['q8']}",
                    overlap=getattr(rule, "overlap", None),
                    b_h_fit=self.step_fit.valid,
                    step_c0_us=(None if self.step_fit.c0_s is None
                                else f"{1e6 * self.step_fit.c0_s:.0f}"),
                    samples_p=self.b_p.taken,
                    samples_h=self.b_h.taken, rejected=self.b_p.rejected + self.b_h.rejected))
        return out

    def _refresh_tables(self) -> None:
        """Rewrite in place the fetch tables captured steps read (their address stays)."""
        for b in self.backends:
            t = getattr(b, "_fetch_table", None)
            if t is None or b.rule.fixed is not None:
                continue
            with torch.inference_mode():  # the table was made inside a forward
                t.copy_(torch.tensor(b.rule.table(b.store.num_experts), dtype=torch.int64))

    def stats(self) -> dict:
        f = self.step_fit
        return {"b_p": round(self.b_p.gbps, 3), "b_h": round(self.b_h.gbps, 3),
                "b_h_fit": None if f.gbps is None else round(f.gbps, 3),
                "step_c0_us": None if f.c0_s is None else round(1e6 * f.c0_s, 1),
                "samples_p": self.b_p.taken, "samples_h": self.b_h.taken,
                "rejected": self.b_p.rejected + self.b_h.rejected, "updates": self.updates}


def timed_branch(fn, stats, expert_bytes: int):
    """`fn(m, x, ids, mask)` (a CPU expert branch) that also hands its bytes and time to
    `stats.reprofiler` when re-profiling is on (looked up per call: it may start later)."""
    def run(m, x, ids, mask):
        rp = stats.reprofiler
        if rp is None:
            return fn(m, x, ids, mask)
        t0 = time.perf_counter()
        y = fn(m, x, ids, mask)
        dt = time.perf_counter() - t0
        n = ids.cpu()[mask.cpu()].unique().numel()
        rp.host_sample(n * expert_bytes, dt)
        return y
    return run


def native_sampler(stats, expert_bytes: int):
    """`sample(experts, seconds)` for `CpuBridge(sample=...)`: a native step's experts
    computed and busy time, handed to `stats.reprofiler` as one B_H sample when re-profiling
    is on (looked up per call: it may start later)."""
    def sample(experts: int, seconds: float) -> None:
        rp = stats.reprofiler
        if rp is not None:
            rp.host_sample(experts * expert_bytes, seconds, per_step=True)
    return sample
