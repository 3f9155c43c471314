"""The proxy soak at full size (issue 22, item 3): `ft agent-proxy` in both modes (N: its
in-process engine; U: in front of `ft serve`) over one tiny random engine on loopback, driven
with mixed traffic (tests/reliability/soak.py) while RSS and open fds are sampled; prints one
JSON line per sample and a final verdict line (flat or not, fitted slopes beside their floors),
and exits 1 when not flat, when fewer than --min-sessions distinct sessions were served, or when
any request got an unexpected answer; the verdict includes the end state (no upstream
connection left ACTIVE, fds back at the start's).

  nice -n 19 python scripts/soak.py                      # 20 minutes, samples every 30 s
  python scripts/soak.py --seconds 60 --sample-s 2 --min-sessions 0 --fronts N,U
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "reliability"))
sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fronts import build_tiny, limits, start_fault_proxy, start_stack
from soak import soak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1200.0)
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--warm-up-s", type=float, default=None,
                    help="samples before this are not fitted (default: a fifth of the run)")
    ap.add_argument("--min-sessions", type=int, default=20000)
    ap.add_argument("--fronts", default="N,U,U*,U*,U*,U*",
                    help="one worker per entry, of N, U and U* (the proxy before a scripted "
                    "instant upstream: cheap sessions, so 20,000 fit beside the engine's)")
    ap.add_argument("--model-dir", default=None, help="where the tiny model is (built once)")
    args = ap.parse_args()
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "ft-reliability-tiny")
    # uvicorn's usual timeouts, not the batteries' short ones: on a loaded machine a pooled
    # connection's next request can take over a second to arrive (a 502, not a leak)
    usual = {"header_timeout_s": 10.0, "body_timeout_s": 30.0, "stall_timeout_s": 30.0}
    stack = start_stack(build_tiny(model_dir), **usual)
    fronts = dict(stack.fronts)
    # (first-byte timeout under the slow upstream's SLOW_S: the mix's `timeout` requests)
    front, mode, up = start_fault_proxy(stack.tok, limits(**usual), first_byte_timeout_s=1.0)
    mode["now"] = "ok"
    fronts["U*"] = front
    try:
        res = soak([fronts[n] for n in args.fronts.split(",")], args.seconds,
                   args.sample_s, args.warm_up_s, log=sys.stdout)
    finally:
        front.served.stop()
        up.stop()
        stack.stop()
    ok = res["flat"] and res["sessions"] >= args.min_sessions and not res["unexpected"]
    print(json.dumps({"verdict": "flat" if res["flat"] else "NOT flat", "ok": ok,
                      "min_sessions": args.min_sessions, **res}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
