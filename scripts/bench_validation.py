"""Per-request CPU time of request validation + chat mapping on the largest recorded bodies.

What the server does to a body before rendering: `parse_json` (UTF-8 JSON, depth, surrogates),
then the API's validation and mapping to the template input (`freetoken.server.state.
chat_request`). Floor beside it: one bare walk that visits every value of the parsed body once
(the least any validator that reads the whole body must spend). Medians over `--reps` runs.

  python scripts/bench_validation.py [--traces DIR] [--reps 50]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

TRACES = Path(__file__).resolve().parents[1] / "tests/data/harness_traces"
SOURCES = {"anthropic": "claude_code/cc_try1.jsonl", "openai": "opencode/oc_prune.jsonl"}


def largest_body(path: Path) -> bytes:
    best = b""
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        body = rec.get("body")
        if isinstance(body, dict) and "messages" in body and "count_tokens" not in rec["path"]:
            raw = json.dumps(body, ensure_ascii=False).encode()
            best = max(best, raw, key=len)
    return best


def bare_walk(v: Any) -> int:
    n, stack = 0, [v]
    while stack:
        x = stack.pop()
        n += 1
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return n


def median_s(fn: Any, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, default=TRACES)
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    from freetoken.server.state import chat_request
    from freetoken.server.validation import parse_json

    print(f"{'api':10s} {'body KB':>8s} {'values':>7s} {'parse ms':>9s} "
          f"{'validate+map ms':>16s} {'floor: bare walk ms':>20s}")
    for api, rel in SOURCES.items():
        raw = largest_body(a.traces / rel)
        body = parse_json(raw)
        chat_request(api, body)  # warm, and must pass
        t_parse = median_s(lambda raw=raw: parse_json(raw), a.reps)
        t_val = median_s(lambda body=body, api=api: chat_request(api, body), a.reps)
        t_walk = median_s(lambda body=body: bare_walk(body), a.reps)
        print(f"{api:10s} {len(raw) / 1024:8.1f} {bare_walk(body):7d} {t_parse * 1e3:9.3f} "
              f"{t_val * 1e3:16.3f} {t_walk * 1e3:20.3f}")


if __name__ == "__main__":
    main()
