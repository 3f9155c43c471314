"""The proxy soak (issue 22's goal: "the proxy's memory and fds flat across 20,000 sessions and a
20-minute soak"): worker threads drive the agent proxy in both modes, N (in-process engine) and
U (in front of `ft serve`), and U* (before the scripted instant upstream of `fronts.fault_app`),
with mixed traffic — OpenAI chat plain and streamed, Anthropic messages streamed,
count_tokens, second turns of earlier sessions, clients that leave mid-stream, bad bodies
answered 4xx, and on U* upstreams too slow for the proxy's first-byte timeout (`timeout`:
answered in-band with `upstream_timeout`) — every new conversation a distinct session. A
sampler reads the process's RSS and open fds every `sample_s`; `verdict` fits a line to the
samples after the warm-up and calls the run flat when none of these fails:

- RSS: fitted growth over the measured window <= `rss_floor_mb` (RSS_FLOOR_MB, 16, for the
  20-minute run: the LRU-capped session state of 20,000 sessions would be ~18 MB unbounded;
  allocator noise stays below it). The engine's preallocated pools are made resident first
  (`fronts.warm_pools`) and malloc keeps one arena (`fronts.cap_malloc_arenas`), so neither
  a pool filling up nor per-thread arenas holding freed memory read as growth;
- fds: fitted growth <= fd_floor(workers) (each worker holds up to two connections in flight,
  so a sample swings by that much);
- the end (`settle`): once the traffic has stopped, no proxy holds an upstream connection
  `ACTIVE` (one left so with nothing in flight is leaked: its socket never closes), and the
  open fds are back at the count before the traffic, give or take FD_SLACK, besides two per
  upstream connection pooled idle for reuse (both ends are in this process).

Before the fix of issue 22's soak (server/scoped.py) every upstream request given up on by a
first-byte timeout, and now and then one whose client left as its stream ended, left its
connection ACTIVE: fds 59 -> 111 in 20 minutes; the CI soak ends with 8 (16 fds) left.

Each sample also counts the Python heap's allocated blocks (`sys.getallocatedblocks`): when RSS
grows and they do not, the growth is native (allocator arenas, torch), not Python objects kept.

The stack is in one process (tests/reliability/fronts.py), so RSS covers proxy and engine.
Used by scripts/soak.py (full size) and tests/reliability/test_soak.py (seconds).
"""
from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from battery import _fds, rss_kb

RSS_FLOOR_MB = 16.0
FD_SLACK = 2


def fd_floor(workers: int) -> int:
    return 4 + 2 * workers


KINDS = ("openai", "openai_stream", "anthropic_stream", "count", "second_turn", "leave",
         "bad_body", "timeout")
ENGINE_KINDS = KINDS[:-1]  # what N and U get: `timeout` needs the scripted upstream (U*)


@dataclass
class Tally:
    requests: int = 0
    sessions: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)  # the first few, for the report
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, kind: str, status: int, ok: bool, new_session: bool) -> None:
        with self.lock:
            self.requests += 1
            self.sessions += new_session
            k = f"{kind}:{status}"
            self.by_status[k] = self.by_status.get(k, 0) + 1
            if not ok and len(self.unexpected) < 10:
                self.unexpected.append(k)


def _one(c: httpx.Client, front: Any, kind: str, sid: int, seen: list[int]) -> tuple[int, bool]:
    """One request of `kind` in session `sid`; (status, as expected)."""
    h = front.auth
    user = {"role": "user", "content": f"soak session {sid}: write one word"}
    if kind == "openai":
        r = c.post("/v1/chat/completions", headers=h, json={
            "model": "m", "max_tokens": 2, "messages": [user]})
        return r.status_code, r.status_code == 200
    if kind == "second_turn" and seen:
        old = seen[sid % len(seen)]
        r = c.post("/v1/chat/completions", headers=h, json={"model": "m", "max_tokens": 2,
                   "messages": [{"role": "user", "content": f"soak session {old}: write one "
                                 "word"}, {"role": "assistant", "content": "ok"},
                                {"role": "user", "content": "and another"}]})
        return r.status_code, r.status_code == 200
    if kind == "count":  # (no session: count_tokens generates nothing)
        r = c.post("/v1/messages/count_tokens", headers=h, json={"model": "m",
                                                                  "messages": [user]})
        return r.status_code, r.status_code == 200
    if kind == "bad_body":
        r = c.post("/v1/chat/completions", headers={**h, "content-type": "application/json"},
                   content=b'{"model": "m", "messages": [{"role": ')
        return r.status_code, 400 <= r.status_code < 500
    if kind == "timeout":  # the proxy gives up on a slow upstream: an in-band 504
        r = c.post("/v1/chat/completions", headers=h, json={
            "model": "fault:slow", "max_tokens": 2, "stream": True, "messages": [user]})
        return r.status_code, r.status_code == 200 and "upstream_timeout" in r.text
    path, body = (("/v1/messages", {"model": "m", "max_tokens": 2, "stream": True,
                                    "messages": [user]}) if kind == "anthropic_stream" else
                  ("/v1/chat/completions", {"model": "m", "max_tokens": 2, "stream": True,
                                            "messages": [user]}))
    with c.stream("POST", path, headers=h, json=body) as r:
        if kind == "leave":  # the client goes after the first bytes
            next(r.iter_bytes(), None)
            return r.status_code, r.status_code == 200
        text = r.read().decode()
    return r.status_code, r.status_code == 200 and "error" not in text.split("data:")[-1]


def drive(fronts: list[Any], seconds: float, tally: Tally, stop: threading.Event) -> None:
    """One worker thread per entry of `fronts` (a front listed twice gets two), each cycling
    KINDS on its front until `seconds` have passed."""
    ids = itertools.count()
    seen: list[int] = []

    def work(w: int) -> None:
        front = fronts[w]
        kinds = KINDS if front.name == "U*" else ENGINE_KINDS
        c = httpx.Client(base_url=front.url, timeout=60)
        t_end = time.time() + seconds
        try:
            for i in itertools.count(w):
                if time.time() >= t_end or stop.is_set():
                    return
                kind = kinds[i % len(kinds)]
                new = kind not in ("second_turn", "bad_body", "count")  # a new session
                sid = next(ids)
                try:
                    status, ok = _one(c, front, kind, sid, seen)
                except httpx.HTTPError as e:
                    status, ok = 0, False
                    tally.unexpected.append(f"{front.name}:{kind}:{type(e).__name__}")
                tally.count(kind, status, ok, new and ok)
                if new and ok and len(seen) < 1000:
                    seen.append(sid)
        finally:
            c.close()

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(len(fronts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _now(t0: float) -> tuple[float, int, int, int]:
    return (round(time.time() - t0, 1), rss_kb(), _fds(), sys.getallocatedblocks())


def sample(samples: list[tuple], sample_s: float, stop: threading.Event,
           log: Any = None, tally: Tally | None = None) -> None:
    """(seconds, RSS kB, open fds, Python blocks) every `sample_s` until `stop`; one JSON line
    each to `log`."""
    t0 = time.time()
    while True:
        s = _now(t0)
        samples.append(s)
        if log is not None:
            print(json.dumps({"t_s": s[0], "rss_mb": round(s[1] / 1024, 1), "fds": s[2],
                              "py_blocks": s[3],
                              "requests": tally.requests if tally else None,
                              "sessions": tally.sessions if tally else None}), file=log,
                  flush=True)
        if stop.wait(sample_s):
            return


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def verdict(samples: list[tuple], warm_up_s: float, workers: int = 4,
            rss_floor_mb: float = RSS_FLOOR_MB, end: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Fitted RSS and fd growth over the samples (seconds, RSS kB, fds[, Python blocks])
    after `warm_up_s`, beside their floors; with `end` (from `settle`), the end state too."""
    kept = [s for s in samples if s[0] >= warm_up_s] or samples[-2:]
    ts = [s[0] for s in kept]
    span = (ts[-1] - ts[0]) if len(ts) > 1 else 0.0
    rss_slope = _slope(ts, [s[1] / 1024 for s in kept])  # MB per second
    fd_slope = _slope(ts, [float(s[2]) for s in kept])
    rss_growth, fd_growth = rss_slope * span, fd_slope * span
    fd_max = fd_floor(workers)
    flat = (len(kept) >= 3 and rss_growth <= rss_floor_mb and fd_growth <= fd_max
            and kept[-1][2] - kept[0][2] <= fd_max and (end is None or end["returned"]))
    blocks = ({"py_blocks_start": kept[0][3], "py_blocks_end": kept[-1][3],
               "py_blocks_fitted_growth": round(_slope(ts, [float(s[3]) for s in kept]) * span)}
              if len(kept[0]) > 3 else {})
    return {"flat": flat, "samples": len(kept), "window_s": round(span, 1),
            "rss_start_mb": round(kept[0][1] / 1024, 1), "rss_end_mb": round(kept[-1][1] / 1024, 1),
            "rss_slope_mb_per_min": round(rss_slope * 60, 3),
            "rss_fitted_growth_mb": round(rss_growth, 2), "rss_floor_mb": rss_floor_mb,
            "fds_start": kept[0][2], "fds_end": kept[-1][2],
            "fd_slope_per_min": round(fd_slope * 60, 3), "fd_fitted_growth": round(fd_growth, 2),
            "fd_floor": fd_max, **blocks, **(end or {})}


def pooled(fronts: list[Any]) -> tuple[int, int]:
    """(ACTIVE, IDLE) upstream connections over the distinct proxy fronts."""
    from fronts import upstream_pool

    pools = [upstream_pool(f) for f in {id(f): f for f in fronts}.values()]
    return (sum(p.get("ACTIVE", 0) for p in pools), sum(p.get("IDLE", 0) for p in pools))


def settle(fronts: list[Any], fds_before: int, idle_before: int, wait_s: float = 5.0
           ) -> dict[str, Any]:
    """After the traffic: wait (at most `wait_s`) for the requests still winding down
    (a left client's stream, a timed-out upstream) to let go of their connections, then
    judge the end state (module docstring, last rule)."""
    t_end = time.time() + wait_s
    while True:
        active, idle = pooled(fronts)
        excess = _fds() - fds_before - 2 * max(idle - idle_before, 0)
        if (active == 0 and excess <= FD_SLACK) or time.time() >= t_end:
            break
        time.sleep(0.1)
    return {"returned": active == 0 and excess <= FD_SLACK, "fds_before": fds_before,
            "fds_after": _fds(), "pooled_active_after": active, "pooled_idle_after": idle,
            "fd_excess_after": excess, "fd_slack": FD_SLACK}


def soak(fronts: list[Any], seconds: float, sample_s: float, warm_up_s: float | None = None,
         log: Any = None, rss_floor_mb: float = RSS_FLOOR_MB) -> dict[str, Any]:
    """Drive `fronts` (one worker each) for `seconds` while sampling; the verdict plus the
    traffic's tally."""
    fds_before, (_, idle_before) = _fds(), pooled(fronts)
    tally, stop, samples = Tally(), threading.Event(), []
    s = threading.Thread(target=sample, args=(samples, sample_s, stop, log, tally), daemon=True)
    s.start()
    t0 = time.time()
    try:
        drive(fronts, seconds, tally, stop)
    finally:
        stop.set()
        s.join()
    samples.append(_now(t0))
    end = settle(fronts, fds_before, idle_before)
    warm = seconds * 0.2 if warm_up_s is None else warm_up_s
    return {**verdict(samples, warm, len(fronts), rss_floor_mb, end), "requests": tally.requests,
            "sessions": tally.sessions,
            "by_status": tally.by_status, "unexpected": tally.unexpected,
            "seconds": round(time.time() - t0, 1)}
