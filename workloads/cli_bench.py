"""`ft bench workload W1|W2|W3|W4|all --endpoint URL ...`: replay workloads and write a report."""
from __future__ import annotations

import argparse
from pathlib import Path

from workloads.registry import NAMES, build_workload
from workloads.report import write_report
from workloads.runner import WorkloadResult, run_workload, summarize


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("workload", help="replay W1–W4 agent workloads against an endpoint")
    p.add_argument("workload", type=str.upper, choices=[*NAMES, "ALL"],
                   help="W1|W2|W3|W4|all")
    p.add_argument("--endpoint", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--api", choices=("anthropic", "openai"), default=None,
                   help="surface to use (default: each workload's recorded one)")
    p.add_argument("--scale", choices=("tiny", "full"), default="full")
    p.add_argument("--out", default="workload_report", help="output directory")
    p.add_argument("--model", default=None, help="model name to put in every request")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", action="store_true", help="also write each workload as JSONL")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    names = list(NAMES) if args.workload == "ALL" else [args.workload]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, WorkloadResult] = {}
    for name in names:
        w = build_workload(name, args.scale, args.seed)
        if args.dump:
            w.to_jsonl(out / f"{name}.jsonl")
        results[name] = run_workload(w, args.endpoint, args.api, model=args.model,
                                     api_key=args.api_key, progress=True)
    path = write_report(results, out)
    for name, s in summarize(results).items():
        rate, ratio = s["mean_decode_tps"], s["stability_vs_w1"]
        other = s["stability_vs_w1_other_sampling"]
        vs = (f"vs W1 at the same sampling {round(ratio, 3)}" if ratio is not None else
              f"vs W1 at another sampling ({', '.join(s['w1_sampling'])}) {round(other, 3)}, "
              "not comparable" if other is not None else "vs W1 —")
        print(f"{name}: mean decode {rate if rate is None else round(rate, 1)} tok/s at "
              f"{'; '.join(s['sampling']) or '—'}, {vs}")
    print(f"report: {path}")
    return 0 if all(r.ok for r in results.values()) else 1
