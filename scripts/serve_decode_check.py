"""Served decode rate through the HTTP API, batch 1 and batch 2 (issue 20 items 2 and 5), on a
machine where `ft serve` just started: no warm-up wait, so kernels that compile in the first
request are in its first tokens, which the rate leaves out (the first SKIP tokens of each
stream).

Usage: python scripts/serve_decode_check.py MODEL OUT_DIR LABEL TOKENS [ft serve args ...]
(ROWS=1,2,4 in the environment: the batch sizes, default 1,2)
Prints `[decode LABEL] ...` lines: start-to-ready phases, the first token of the first
request, then per batch size the aggregate decode tok/s over the tokens past SKIP, and the
expert counters of /v1/stats over that window (hit rate, misses per step, CPU share) and where
a decode step's time went (`step_phases`: ms per step in the engine's step, blocked on the
device, the rest on the host, and between steps).
Writes OUT_DIR/decode-LABEL.json and the server log OUT_DIR/serve-LABEL.log.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx

from freetoken.bench.cli_bench_serve import expert_delta, phase_delta
from freetoken.bench.serve_process import ServerProcess

SKIP = 32  # tokens left out at the start of each stream (first-request compiles, captures)


def _stream(endpoint: str, n: int, seed: int, out: dict) -> None:
    """One forced stream of n tokens: out['t'] = arrival time of every content chunk."""
    body = {"model": "m", "stream": True, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": f"Count to {seed}."}]}
    ts: list[float] = []
    out["t0"] = time.perf_counter()
    with httpx.stream("POST", endpoint + "/v1/chat/completions", json=body,
                      timeout=900.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for ch in json.loads(line[5:]).get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    ts.append(time.perf_counter())
    out["t"] = ts


def _delta(before: dict, after: dict) -> dict | None:
    d = expert_delta(before, after)
    if d and d.get("misses"):
        d["cpu_share"] = round(d["cpu_experts"] / d["misses"], 3)
    return d


def run_batch(srv: ServerProcess, rows: int, n: int) -> dict:
    outs = [{} for _ in range(rows)]
    ths = [threading.Thread(target=_stream, args=(srv.endpoint, n, 7 + i, outs[i]))
           for i in range(rows)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    # the window: from the last stream's SKIP-th token to the last stream's end
    starts = [o["t"][SKIP] for o in outs if len(o.get("t", [])) > SKIP]
    ends = [o["t"][-1] for o in outs if len(o.get("t", [])) > SKIP]
    toks = sum(len(o.get("t", [])) - SKIP - 1 for o in outs if len(o.get("t", [])) > SKIP)
    span = max(ends) - max(starts) if starts else 0.0
    return {"rows": rows, "tokens": [len(o.get("t", [])) for o in outs],
            "first_token_s": [round(o["t"][0] - o["t0"], 2) for o in outs if o.get("t")],
            "tok_s": round(toks / span, 1) if span > 0 else None}


def main(argv: list[str]) -> int:
    model, out, label, n, serve_args = argv[0], Path(argv[1]), argv[2], int(argv[3]), argv[4:]
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"label": label, "serve_args": serve_args, "tokens": n}
    with ServerProcess(model, serve_args, out / f"serve-{label}.log") as srv:
        srv.wait_ready(900)
        res["phases"] = srv.phases()
        print(f"[decode {label}] " + " ".join(f"{k}={v:.1f}" for k, v in res["phases"].items()),
              flush=True)
        for rows in (int(r) for r in os.environ.get("ROWS", "1,2").split(",")):
            a = srv.stats()
            r = run_batch(srv, rows, n)
            b = srv.stats()
            r["experts"], r["step_phases"] = _delta(a, b), phase_delta(a, b)
            r["decode_phases_raw"] = [a.get("decode_phases"), b.get("decode_phases")]
            res[f"batch{rows}"] = r
            print(f"[decode {label}] batch={rows} tok_s={r['tok_s']} tokens={r['tokens']} "
                  f"first_token_s={r['first_token_s']} experts={r['experts']}", flush=True)
            print(f"[decode {label}] batch={rows} step_phases={r['step_phases']} "
                  f"raw={r['decode_phases_raw']}", flush=True)
    (out / f"decode-{label}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
