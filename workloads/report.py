"""Workload report: `report.md` (per-turn table + summary), `results.json` and PNG plots.

Plots: decode tok/s per turn, TTFT per turn, cached vs recomputed prompt tokens per turn, and
the W3 concurrency timeline (one bar per request from send to last byte).
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from workloads.runner import WorkloadResult, summarize


def _f(x: float | None, nd: int = 1) -> str:
    return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown(results: dict[str, WorkloadResult]) -> str:
    lines = ["# Workload replay", ""]
    summ = summarize(results)
    lines += [("| workload | version | api | turns | errors | wall s | mean decode tok/s | "
              "vs W1 |"), "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = summ[name]
        lines.append(f"| {name} | `{r.version}` | {r.api} | {len(r.turns)} | "
                     f"{sum(t.error is not None for t in r.turns)} | {r.wall_s:.2f} | "
                     f"{_f(s['mean_decode_tps'])} | {_f(s['stability_vs_w1'], 3)} |")
    for name, r in results.items():
        lines += ["", f"## {name} ({r.endpoint})", "",
                  ("| turn | session | start s | TTFT s | decode tok/s | out (forced) | prompt | "
                  "cached | recomputed | error |"), "|---|---|---|---|---|---|---|---|---|---|"]
        for t in r.turns:
            lines.append(f"| {t.turn_id} | {t.session[:12]} | {t.start:.3f} | "
                         f"{_f(t.ttft_s, 3)} | {_f(t.decode_tps)} | {t.output_tokens} "
                         f"({t.expected_output_tokens}) | {_f(t.prompt_tokens)} | "
                         f"{_f(t.cached_tokens)} | {_f(t.recomputed_tokens)} | "
                         f"{t.error or ''} |")
    return "\n".join(lines) + "\n"


def _per_turn(results: dict[str, WorkloadResult], attr: str, ylabel: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, r in results.items():
        ys = [getattr(t, attr) for t in r.turns]
        ax.plot(range(1, len(ys) + 1), [float("nan") if y is None else y for y in ys],
                marker="o", label=name)
    ax.set_xlabel("turn (launch order)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cache(results: dict[str, WorkloadResult], path: Path) -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        x = range(1, len(r.turns) + 1)
        cached = [t.cached_tokens or 0 for t in r.turns]
        recomputed = [t.recomputed_tokens or 0 for t in r.turns]
        ax.bar(x, cached, label="cached", color="tab:green")
        ax.bar(x, recomputed, bottom=cached, label="recomputed", color="tab:red")
        ax.set_title(name)
        ax.set_xlabel("turn")
        ax.set_ylabel("prompt tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline(r: WorkloadResult, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(r.turns) + 1.5))
    for i, t in enumerate(r.turns):
        color = "tab:orange" if t.group == "fanout" else "tab:blue"
        ax.barh(i, t.end - t.start, left=t.start, color=color)
        if t.first_token is not None:
            ax.plot([t.first_token], [i], "k|")
    ax.set_yticks(range(len(r.turns)), [t.turn_id for t in r.turns])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since start (| = first token)")
    ax.set_title(f"{r.workload} concurrency timeline (orange: sub-agents)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict[str, WorkloadResult], out_dir: str | Path) -> Path:
    """Write report.md, results.json and the PNGs into `out_dir`; return report.md's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [("decode_rate.png", lambda p: _per_turn(results, "decode_tps", "decode tok/s", p)),
            ("ttft.png", lambda p: _per_turn(results, "ttft_s", "TTFT s", p)),
            ("cache.png", lambda p: _cache(results, p))]
    if "W3" in results:
        jobs.append(("w3_timeline.png", lambda p: _timeline(results["W3"], p)))
    for name, job in tqdm(jobs, desc="report", unit="plot"):
        job(out / name)
    (out / "results.json").write_text(json.dumps(
        {"summary": summarize(results), "workloads": {k: r.to_json() for k, r in
                                                       results.items()}}, indent=1))
    md = markdown(results) + "\n" + "\n".join(f"![{n}]({n})" for n, _ in jobs) + "\n"
    path = out / "report.md"
    path.write_text(md)
    return path
