"""Start `ft serve` and time what a user meets (issue #24 item 2, #20 item 6): start → ready split
into phases, the first request's first token right after ready (the idle warm-up has barely
begun), the idle warm-up's own seconds, then first tokens of prompts of several lengths once
it is done (a TTFT stall there means a shape the warm-up missed), and the decode attention
plan: on a first start the server decodes on Triton while flashinfer's module builds in the
background (`ft.engine: attention_plan kind=triton building=flashinfer`), then switches
(`ft.engine: attention_switch ... build_s=`); a restart starts on flashinfer.

Usage: python scripts/serve_start_check.py MODEL OUT_DIR LABEL [ft serve args ...]
START_QUICK=1: no prompts after the warm-up; instead the server must still be alive with no
failed warm-up task and answer once more (a cold-start crash check, issue #20 item 1).
Prints one `[start LABEL] key=value ...` line per figure and writes OUT_DIR/start-LABEL.json and
the server's log OUT_DIR/serve-LABEL.log. The kernel caches are the environment's
(`XDG_CACHE_HOME`): an empty one is a first start on the machine, a used one a restart.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from freetoken.bench.serve_process import ServerProcess, parse_phases

# prompt lengths in words (about tokens): short, a chunk, past the prefill stream threshold
PROMPTS = (160, 1000, 3000)


def _warm_up_done(srv: ServerProcess, timeout_s: float) -> dict:
    """/v1/stats `warmup` once no task is left and no attention build runs (or at timeout)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        w = srv.stats().get("warmup") or {}
        if w.get("pending", 1) == 0 and not w.get("attention_building"):
            return w
        time.sleep(1.0)
    return srv.stats().get("warmup") or {}


def _attention_lines(log: str) -> dict:
    """The decode attention plan's story in the server log (engine/attention_build.py)."""
    out: dict = {}
    m = re.search(r"ft\.engine: attention_plan kind=(\S+)(?: built=\S+)?(?: load_s=\S+)?"
                  r"(?: building=(\S+))?", log)
    if m:
        out["first"], out["building"] = m.group(1), m.group(2)
    m = re.search(r"ft\.engine: attention_switch old=(\S+) new=(\S+) build_s=(\S+)", log)
    if m:
        out["switch"], out["build_s"] = f"{m.group(1)}->{m.group(2)}", float(m.group(3))
    m = re.search(r"ft\.engine: attention_(build|load)_failed .*", log)
    if m:
        out["failed"] = m.group(0)[:200]
    return out


def main(argv: list[str]) -> int:
    model, out, label, serve_args = argv[0], Path(argv[1]), argv[2], argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"label": label, "serve_args": serve_args}
    with ServerProcess(model, serve_args, out / f"serve-{label}.log") as srv:
        srv.wait_ready(900)
        res["phases"] = srv.phases()
        res["first_token_s"] = srv.first_token_s()  # right after ready: no warm-up before it
        t0 = time.perf_counter()
        res["warmup"] = _warm_up_done(srv, 300)
        res["warmup_wait_s"] = time.perf_counter() - t0
        res["idle_warm_up_s"] = parse_phases(srv.log_text()).get("warm_up_idle")
        res["attention"] = _attention_lines(srv.log_text())
        if os.environ.get("START_QUICK"):
            log_text = srv.log_text()
            failed = re.findall(r"warm_up_task_failed|step_failed|Traceback", log_text)
            again = srv.first_token_s() if srv.alive() else None
            res["crash_check"] = {"alive": srv.alive(), "failures": len(failed),
                                  "bridge_dropped": len(re.findall(r"bridge_dropped|"
                                                                   r"cpu_bridge_failed",
                                                                   log_text)),
                                  "answered_again_s": again}
            res["ttft_after_warm_up"] = {}
        else:
            res["ttft_after_warm_up"] = {
                str(n): srv.first_token_s(" ".join(f"w{i % 97}" for i in range(n)))
                for n in PROMPTS}
    ph = res["phases"]
    print(f"[start {label}] " + " ".join(f"{k}={v:.1f}" for k, v in ph.items())
          + f" first_token={res['first_token_s']:.2f}", flush=True)
    w = res["warmup"]
    print(f"[start {label}] idle_warm_up_s={res['idle_warm_up_s']} tasks={w.get('done')} "
          f"pending={w.get('pending')} graphs={w.get('graphs')} slowest="
          + ",".join(f"{d['task']}:{d['seconds']}" for d in w.get("slowest") or []), flush=True)
    a = res["attention"]
    print(f"[start {label}] attention={w.get('attention')} first_plan={a.get('first')} "
          f"building={a.get('building')} switched={a.get('switch')} "
          f"build_s={a.get('build_s')} failed={a.get('failed')}", flush=True)
    if "crash_check" in res:
        c = res["crash_check"]
        ok = c["alive"] and not c["failures"] and c["answered_again_s"] is not None
        print(f"[start {label}] crash_check {'PASS' if ok else 'FAIL'} alive={c['alive']} "
              f"failures={c['failures']} bridge_dropped={c['bridge_dropped']} "
              f"answered_again_s={c['answered_again_s']}", flush=True)
    print(f"[start {label}] ttft_after_warm_up " + " ".join(
        f"{n}w={s:.2f}" for n, s in res["ttft_after_warm_up"].items()), flush=True)
    (out / f"start-{label}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
