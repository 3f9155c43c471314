"""`ft bench serve --model DIR | --shape NAME [--layers N] [--moe-backend B] [--moe-cache-rate R]
[--route-trace shared|FILE]`: the product's own end-to-end benchmark.

Starts `ft serve` as a subprocess (serve_process.py), reports start → ready split into load /
bandwidth profile / warm-up / other, replays W1–W4 through the HTTP API with the workload
runner, and writes the workload report plus `serve_report.md`: the start-up phases, the
stability table (mean decode of W2–W4 / W1) and the expert stats (`/v1/stats`, per workload as
the difference around it) with each workload's byte floor beside its decode rate when a
bandwidth profile for the machine exists.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx

from freetoken.bench.serve_process import ServerProcess, parse_phases

_COUNTERS = ("hits", "misses", "fetched", "cpu_experts", "fetch_bytes", "cpu_bytes", "streamed",
             "stream_bytes")


def register(subparsers: argparse._SubParsersAction) -> None:
    from freetoken.types.presets import SHAPES

    p = subparsers.add_parser("serve", help="start ft serve, time start→ready, run W1–W4 "
                                            "through the HTTP API, write the report")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (safetensors or FTW)")
    src.add_argument("--shape", choices=sorted(SHAPES),
                     help="write a random-weight checkpoint of this shape first (`ft bench "
                          "checkpoint`) into --work-dir, reused when already there")
    p.add_argument("--layers", type=int, default=None, help="with --shape: cut to N layers")
    p.add_argument("--format", choices=("safetensors", "ftw", "random"), default="safetensors",
                   dest="fmt", help="with --shape: the checkpoint format (random: no weight "
                   "files, the server makes them in memory: a shape larger than the disk)")
    p.add_argument("--work-dir", default=None, help="with --shape: where the checkpoint goes "
                                                    "(default OUT/checkpoint)")
    p.add_argument("--moe-backend", default=None)
    p.add_argument("--moe-cache-rate", type=float, default=None)
    p.add_argument("--route-trace", default=None,
                   help="shared | FILE (.npy [steps, L, N, K]): the served model routes decode "
                        "steps by a replayed trained router")
    p.add_argument("--workloads", default="W1,W2,W3,W4", help="comma-separated")
    p.add_argument("--scale", choices=("tiny", "full"), default="full")
    p.add_argument("--api", choices=("anthropic", "openai"), default=None)
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra `ft serve` argument (repeatable, e.g. --serve-arg=--device=cpu)")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--out", default="serve_bench", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _model_dir(args: argparse.Namespace, out: Path) -> Path:
    if args.model:
        return Path(args.model)
    from freetoken.bench.checkpoint_writer import write_checkpoint

    d = Path(args.work_dir) if args.work_dir else out / "checkpoint"
    if (d / "config.json").exists():
        print(f"[bench serve] reusing the checkpoint in {d}", flush=True)
        return d
    print(f"[bench serve] writing a random {args.shape} checkpoint to {d}", flush=True)
    write_checkpoint(args.shape, args.layers, d, args.fmt, seed=args.seed)
    return d


def _serve_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    if args.moe_backend:
        out += ["--moe-backend", args.moe_backend]
    if args.moe_cache_rate is not None:
        out += ["--moe-cache-rate", str(args.moe_cache_rate)]
    if args.route_trace:
        out += ["--route-trace", args.route_trace]
    return out + list(args.serve_arg)


def expert_delta(before: dict, after: dict) -> dict[str, Any] | None:
    a, b = after.get("experts"), before.get("experts") or {}
    if not a:
        return None
    d: dict[str, Any] = {k: a.get(k, 0) - b.get(k, 0) for k in _COUNTERS}
    routed = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / routed if routed else None
    d["backend"], d["slots"] = a.get("backend"), a.get("slots")
    auto = a.get("auto")  # what `auto` ran at the workload's end, and what it timed
    if auto:
        d["auto"] = auto
        d["backend"] = f"auto: {auto.get('running')} ({auto.get('phase')})"
    return d


def phase_delta(before: dict, after: dict) -> dict[str, Any] | None:
    """Mean milliseconds per decode-only step between two /v1/stats reads (`decode_phases`):
    in the engine's step (`step`: of it `wait` blocked on the device's tokens, `host` the
    rest) and `between` steps (the engine thread's loop); None without decode steps."""
    a, b = after.get("decode_phases"), before.get("decode_phases") or {}
    if not a:
        return None
    n = a["steps"] - b.get("steps", 0)
    if n <= 0:
        return None
    ms = {k: 1e3 * (a[f"{k}_s"] - b.get(f"{k}_s", 0.0)) / n for k in ("step", "wait", "between")}
    return {"steps": n, "step_ms": round(ms["step"], 3), "wait_ms": round(ms["wait"], 3),
            "host_ms": round(ms["step"] - ms["wait"], 3), "between_ms": round(ms["between"], 3)}


def _floor_tok_s(d: dict[str, Any] | None, tokens: int, bw: tuple[float, float] | None
                 ) -> float | None:
    """Decode tok/s the expert bytes allow: fetched bytes over B_P and CPU-read bytes over B_H,
    overlapped at best (hybrid), per generated token."""
    if d is None or bw is None or tokens <= 0:
        return None
    t = max(d["fetch_bytes"] / tokens / (bw[0] * 1e9), d["cpu_bytes"] / tokens / (bw[1] * 1e9))
    return 1.0 / t if t > 0 else None


def _bandwidths(model_dir: Path) -> tuple[float, float] | None:
    """(B_P, B_H) GB/s of this machine's cached `ft bench bw` profile for the model's expert
    shape and bank format (a quantized checkpoint's own: its bytes and its CPU kernel)."""
    try:
        from freetoken.experts.profile import load_profile, profile_key, shape_for
        from freetoken.types.model_config import load_config

        cfg = load_config(model_dir)
        prof = load_profile(profile_key(shape_for(cfg)[0], cfg.expert_format))
    except Exception:  # noqa: BLE001 (no profile is a normal case: no floor column)
        return None
    if prof is None or not prof.b_p:
        return None
    return float(prof.b_p), float(prof.b_h)


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def report_markdown(meta: dict[str, Any], phases: dict[str, float], rows: list[dict[str, Any]]
                    ) -> str:
    lines = ["# ft bench serve", "", "```", json.dumps(meta, indent=1), "```", "",
             "## Start to ready", "", "| phase | seconds |", "|---|---|"]
    for k in ("load", "weights_read", "profile", "warm_up", "other", "imports", "tokenizer",
              "engine_build", "ready"):
        if k in phases:
            label = {"weights_read": "  of which weights read", "ready": "**start → ready**",
                     "other": "other (imports, tokenizer, HTTP)",
                     "imports": "  of which imports (process start → build)",
                     "tokenizer": "  of which tokenizer",
                     "engine_build": "  of which engine build (pools, runner)"}.get(k, k)
            lines.append(f"| {label} | {phases[k]:.1f} |")
    if "first_token" in phases:
        lines.append(f"| ready → first token | {phases['first_token']:.2f} |")
    if "warm_up_idle" in phases:
        lines.append(f"| idle warm-up after ready (not blocking) | {phases['warm_up_idle']:.1f} |")
    lines += ["", "## Decode stability (mean decode tok/s; W2–W4 against W1)", "",
              "| workload | turns | ok | mean decode tok/s | floor tok/s | vs W1 | wall s |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['turns']} | {r['ok']} | {_fmt(r['tps'])} | "
                     f"{_fmt(r['floor'])} | {_fmt(r['vs_w1'], 3)} | {r['wall_s']:.1f} |")
    lines += ["", "## Expert cache per workload (/v1/stats, difference around the workload)", "",
              ("| workload | backend | slots | hit rate | misses | fetched | CPU experts | "
              "fetch MB/token | CPU MB/token |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, n = r["experts"], max(r["tokens"], 1)
        if d is None:
            lines.append(f"| {r['workload']} | (no expert stats: fused, or no answer) |"
                         + " |" * 7)
            continue
        lines.append(f"| {r['workload']} | {d['backend']} | {d['slots']} | "
                     f"{_fmt(d['hit_rate'], 3)} | {d['misses']} | {d['fetched']} | "
                     f"{d['cpu_experts']} | {d['fetch_bytes'] / n / 1e6:.1f} | "
                     f"{d['cpu_bytes'] / n / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from workloads.registry import build_workload
    from workloads.report import write_report
    from workloads.runner import WorkloadResult, run_workload

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(args, out)
    names = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    meta = {"model": str(model_dir), "serve_args": _serve_args(args), "scale": args.scale,
            "workloads": names, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    srv = ServerProcess(str(model_dir), _serve_args(args), out / "serve.log")
    results: dict[str, WorkloadResult] = {}
    stats: dict[str, dict[str, Any] | None] = {}
    with srv:
        srv.wait_ready(args.ready_timeout)
        phases = srv.phases()
        print("[bench serve] ready: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()),
              flush=True)
        try:
            phases["first_token"] = srv.first_token_s()
        except httpx.HTTPError as e:
            print(f"[bench serve] the first request failed: {e!r}", flush=True)
        for name in names:
            if not srv.alive():  # a crash is a result: report what ran, and the log's tail
                print(f"[bench serve] the server died before {name}:\n{srv.log_tail()}")
                meta["server_died_before"] = name
                break
            before = srv.stats()
            w = build_workload(name, args.scale, args.seed)
            print(f"[bench serve] {name}: {len(w.turns)} turns", flush=True)
            results[name] = run_workload(w, srv.endpoint, args.api, progress=True)
            stats[name] = expert_delta(before, srv.stats())
        # the idle warm-up ran after ready, between requests: its total and its slowest tasks
        idle = parse_phases(srv.log_text()).get("warm_up_idle")
        if idle is not None:
            phases["warm_up_idle"] = idle
        meta["warmup"] = srv.stats().get("warmup")
    bw = _bandwidths(model_dir)
    meta["bandwidth_profile_gbps"] = list(bw) if bw else None
    w1 = results["W1"].mean_decode_tps if "W1" in results else None
    rows = []
    for name, r in results.items():
        tokens = sum(t.output_tokens for t in r.turns)
        tps = r.mean_decode_tps
        rows.append({"workload": name, "turns": len(r.turns), "ok": r.ok, "tps": tps,
                     "vs_w1": tps / w1 if tps is not None and w1 else None, "wall_s": r.wall_s,
                     "tokens": tokens, "experts": stats[name],
                     "floor": _floor_tok_s(stats[name], tokens, bw)})
    if results:
        write_report(results, out)
    text = report_markdown(meta, phases, rows)
    (out / "serve_report.md").write_text(text)
    (out / "serve_report.json").write_text(json.dumps(
        {"meta": meta, "phases": phases, "workloads": rows}, indent=1, default=str))
    print(text)
    print(f"report: {out / 'serve_report.md'} (workload report in {out})")
    died = "server_died_before" in meta
    return 0 if all(r.ok for r in results.values()) and not died else 1
