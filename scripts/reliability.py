"""The reliability suite at full size (issue 22, item 7): the batteries of
tests/reliability/battery.py against S (`ft serve`), N (`ft agent-proxy`, in-process engine) and
U (`ft agent-proxy --upstream S`) over one tiny random engine, on loopback, printing one JSON
line per battery and front, and exiting 1 if any goal is missed.

  python scripts/reliability.py                      # full size: 2,000 bodies a front, ...
  python scripts/reliability.py --fuzz 200 --sessions 2000 --slowloris 100 --flood 1000
  python scripts/reliability.py --only fuzz,browser --fronts N,U

Goals: 0 5xx and 0 wrong shapes in the fuzz; every hostile browser request refused; the door's
own refusals in shape (413, 408, mid-body disconnects, wrong keys rate-limited); every
slowloris connection closed by the header timeout; a request served during a flood of
half-open connections, with under 50 log lines; served again right after the process ran
out of descriptors; forged control tokens stay text; every
upstream fault an in-shape error within its timeout; the proxy's session state capped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "reliability"))
sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from battery import browser, flood, forgery, fuzz, sessions, slowloris, upstream_faults
from door import door, door_ok, fd_exhaustion
from fronts import FAULTS, build_tiny, start_fault_proxy, start_stack

ALL = ("fuzz", "browser", "door", "slowloris", "flood", "fds", "forgery", "faults", "sessions")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuzz", type=int, default=2000, help="fuzzed bodies per front")
    ap.add_argument("--slowloris", type=int, default=550, help="dribbling connections")
    ap.add_argument("--flood", type=int, default=5000, help="half-open connections")
    ap.add_argument("--sessions", type=int, default=20000, help="proxy sessions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fronts", default="S,N,U")
    ap.add_argument("--only", default=",".join(ALL), help=f"batteries, of {','.join(ALL)}")
    ap.add_argument("--model-dir", default=None, help="where the tiny model is (built once)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    names = args.fronts.split(",")
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "ft-reliability-tiny")
    failed = False

    def report(battery: str, front: str, res: object, ok: bool) -> None:
        nonlocal failed
        failed |= not ok
        print(json.dumps({"battery": battery, "front": front, "ok": ok, **(
            res if isinstance(res, dict) else vars(res))}, default=str), flush=True)

    t0 = time.time()
    stack = start_stack(build_tiny(model_dir))
    try:
        for n in names:
            f = stack.fronts[n]
            if "fuzz" in only:
                t = time.time()
                r = fuzz(f, args.fuzz, seed=args.seed + names.index(n))
                report("fuzz", n, {**vars(r), "seconds": round(time.time() - t, 1)},
                       r.five_xx == 0 and r.bad_shape == 0)
            if "browser" in only:
                r = browser(f)
                report("browser", n, r, r["refused"] == r["sent"])
            if "slowloris" in only:
                r = slowloris(f, args.slowloris)
                report("slowloris", n, r, r["closed"] == r["opened"])
            if "flood" in only:
                r = flood(f, args.flood)
                report("flood", n, r, r["request_ok"] and r["after_status"] == 200
                       and r["log_lines"] < 50)
            if "door" in only:
                r = door(f, client_ip=f"127.0.0.{10 + names.index(n)}")
                report("door", n, r, door_ok(r))
            if "fds" in only:
                r = fd_exhaustion(f)
                report("fds", n, r, r["status_after"] == 200 and r["log_lines"] < 50)
            if "forgery" in only:
                r = forgery(f, stack.engine)
                report("forgery", n, r, all(r.values()))
        for api in ("openai", "anthropic") if "faults" in only else ():
            front, mode, up = start_fault_proxy(stack.tok, api=api, first_byte_timeout_s=2.0,
                                                idle_timeout_s=1.5, total_timeout_s=5.0)
            try:
                res = upstream_faults(front, mode, ("ok", *FAULTS[:-1]), limit_s=7.0)
            finally:
                front.served.stop()
                up.stop()
            for r in res:
                report("faults", f"U({api} upstream)", r, r["ok"])
        if "sessions" in only:
            front, mode, up = start_fault_proxy(stack.tok)
            mode["now"] = "ok"
            try:
                r = sessions(front, front.served.app, args.sessions)
            finally:
                front.served.stop()
                up.stop()
            report("sessions", "U", r, r["kept"] <= r["cap"] and r["stats_bytes"] < 100_000)
    finally:
        stack.stop()
    print(json.dumps({"done": True, "ok": not failed, "seconds": round(time.time() - t0, 1)}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
