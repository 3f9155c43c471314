"""RSS of the production processes under mixed traffic, per malloc setting (issue 22):
for each setting, `ft serve --model demo`, `ft agent-proxy --model demo` (N: its in-process
engine) and `ft agent-proxy --upstream` in front of that serve (U) run as their own processes,
all settings at once (the same machine load for each), driven with the soak's request mix
(tests/reliability/soak.py: OpenAI plain and streamed, Anthropic streamed, count_tokens,
second turns, clients leaving mid-stream, bad bodies) plus longer generations. Every
`--sample-s` it prints one JSON line of each process's VmRSS, threads and fds (from /proc),
then one summary line per process: RSS after the warm-up, at the end, the peak, and the
fitted growth over the measured window.

A setting `A/T` runs the processes with `FT_MALLOC_ARENA_MAX=A` and
`FT_MALLOC_MMAP_THRESHOLD=T` (freetoken/envs.py; `ft` applies them with mallopt at its start,
freetoken/cli/malloc.py): `0/0` is glibc's defaults (8 arenas per core, the dynamic mmap
threshold), `2/0` two arenas, `0/131072` the fixed threshold. `arena_heaps` counts the thread
arenas' heaps in /proc/PID/maps.

  nice -n 19 python scripts/arena_rss.py --seconds 300            # 0/0, 2/0 and 0/131072
  python scripts/arena_rss.py --seconds 60 --sample-s 5 --settings 0/0,1/0
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))

import httpx
from soak import ENGINE_KINDS, _one

KINDS = (*ENGINE_KINDS, "long")


@dataclass
class Front:  # what soak._one reads of a front
    name: str
    url: str
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc(pid: int) -> dict[str, int]:
    out = {"rss_kb": 0, "threads": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_kb"] = int(line.split()[1])
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    out["heaps"] = _arena_heaps(pid)
    return out


HEAP_MAX = 64 << 20  # a glibc thread arena's heap: a 64 MiB-aligned reservation (64-bit)


def _arena_heaps(pid: int) -> int:
    """Thread arenas' heaps in the process's maps: an anonymous read-write mapping at a 64 MiB
    boundary followed by its no-access rest, 64 MiB in all (an arena that outgrows one heap
    takes another, so this counts arenas or a little more)."""
    maps = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            maps.append((lo, hi, parts[1], len(parts) > 5))
    n = 0
    for (lo, hi, perm, named), nxt in zip(maps, maps[1:] + [(0, 0, "", True)]):
        if named or perm != "rw-p" or lo % HEAP_MAX:
            continue
        end = nxt[1] if nxt[0] == hi and nxt[2] == "---p" and not nxt[3] else hi
        n += end - lo == HEAP_MAX
    return n


def _wait_up(url: str, p: subprocess.Popen, timeout_s: float = 300.0) -> None:
    t_end = time.time() + timeout_s
    while time.time() < t_end:
        if p.poll() is not None:
            raise SystemExit(f"{url}: the process exited ({p.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"{url}: not up within {timeout_s} s")


def start(setting: str, key_file: Path, logs: Path, engine_args: list[str]
          ) -> tuple[list[Front], list[subprocess.Popen]]:
    arenas, threshold = setting.split("/")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
           "FT_MALLOC_ARENA_MAX": arenas, "FT_MALLOC_MMAP_THRESHOLD": threshold,
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    key = key_file.read_text().strip()
    ps, fronts = [], []
    ports = {n: _port() for n in ("S", "N", "U")}
    cmds = {
        "S": ["serve", "--model", "demo"],
        "N": ["agent-proxy", "--model", "demo"],
        "U": ["agent-proxy", "--upstream", f"http://127.0.0.1:{ports['S']}",
              "--upstream-api-key-file", str(key_file)],
    }
    for name in ("S", "N", "U"):
        cmd = [sys.executable, "-m", "freetoken.cli", *cmds[name], "--port", str(ports[name]),
               "--api-key-file", str(key_file), *(engine_args if name != "U" else [])]
        with open(logs / f"{name}-{arenas}-{threshold}.log", "w") as out:  # (the child keeps it)
            p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        ps.append(p)
        url = f"http://127.0.0.1:{ports[name]}"
        _wait_up(url, p)
        fronts.append(Front(f"{name}{setting}", url, key))
    return fronts, ps


def drive(front: Front, t_end: float, counts: dict[str, int], lock: threading.Lock) -> None:
    ids, seen = itertools.count(), []
    c = httpx.Client(base_url=front.url, timeout=120)
    try:
        for i in itertools.count():
            if time.time() >= t_end:
                return
            kind = KINDS[i % len(KINDS)]
            sid = next(ids)
            try:
                if kind == "long":
                    r = c.post("/v1/chat/completions", headers=front.auth, json={
                        "model": "m", "max_tokens": 48, "messages": [
                            {"role": "user", "content": f"session {sid}: tell me a story " * 8}]})
                    status = r.status_code
                else:
                    status, _ = _one(c, front, kind, sid, seen)
            except httpx.HTTPError as e:
                status = type(e).__name__
            if kind not in ("second_turn", "bad_body", "count") and len(seen) < 1000:
                seen.append(sid)
            with lock:
                k = f"{front.name}:{status}"
                counts[k] = counts.get(k, 0) + 1
    finally:
        c.close()


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--warm-up-s", type=float, default=None, help="default: a fifth of the run")
    ap.add_argument("--settings", default="0/0,2/0,0/131072",
                    help="ARENAS/THRESHOLD pairs (module docstring), run at once")
    ap.add_argument("--workers", type=int, default=2, help="client threads per front")
    ap.add_argument("--engine-args", default="",
                    help="extra flags of the two engines (S, N), e.g. small pools that fill "
                    "within the warm-up: '--kv-tokens 8192 --state-slots 16 --kept-logits 8 "
                    "--state-host-mem 8000000'")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ft-arenas-"))
    key_file = tmp / "key"
    key_file.write_text(secrets.token_hex(16) + "\n")
    fronts, procs = [], []
    try:
        for s in args.settings.split(","):
            f, p = start(s, key_file, tmp, args.engine_args.split())
            fronts += f
            procs += p
        pids = {f.name: p.pid for f, p in zip(fronts, procs)}
        counts: dict[str, int] = {}
        lock = threading.Lock()
        t0 = time.time()
        t_end = t0 + args.seconds
        threads = [threading.Thread(target=drive, args=(f, t_end, counts, lock), daemon=True)
                   for f in fronts for _ in range(args.workers)]
        for t in threads:
            t.start()
        samples: dict[str, list[tuple[float, dict[str, int]]]] = {n: [] for n in pids}
        while True:
            now = round(time.time() - t0, 1)
            line = {"t_s": now}
            for n, pid in pids.items():
                st = _proc(pid)
                samples[n].append((now, st))
                line[n] = {"rss_mb": round(st["rss_kb"] / 1024, 1), "threads": st["threads"],
                           "fds": st["fds"], "heaps": st["heaps"]}
            print(json.dumps(line), flush=True)
            if time.time() >= t_end:
                break
            time.sleep(min(args.sample_s, max(t_end - time.time(), 0.0)))
        for t in threads:
            t.join()
        warm = args.seconds * 0.2 if args.warm_up_s is None else args.warm_up_s
        for n, ss in samples.items():
            kept = [s for s in ss if s[0] >= warm] or ss[-2:]
            ts, rss = [s[0] for s in kept], [s[1]["rss_kb"] / 1024 for s in kept]
            span = ts[-1] - ts[0]
            print(json.dumps({
                "process": n, "rss_start_mb": round(rss[0], 1), "rss_end_mb": round(rss[-1], 1),
                "rss_peak_mb": round(max(s[1]["rss_kb"] for s in ss) / 1024, 1),
                "rss_fitted_growth_mb": round(_slope(ts, rss) * span, 1), "window_s": span,
                "threads": kept[-1][1]["threads"],
                "arena_heaps": max(s[1]["heaps"] for s in ss),
                "requests": {k.split(":", 1)[1]: v for k, v in counts.items()
                             if k.split(":", 1)[0] == n}}), flush=True)
        print(json.dumps({"logs": str(tmp)}), flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
