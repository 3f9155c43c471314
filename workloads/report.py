"""Workload report: `report.md` (per-turn table + summary), `results.json` and PNG plots.

Plots, one panel per workload with integer turn ticks: decode tok/s and TTFT per turn (main
and sub-agent turns as separate series, failed turns marked), cached / new / missed prompt
tokens per turn (`new_tokens`: what the session never sent before, so a cache miss shows apart
from new tool output), and the W3 concurrency timeline (one bar per request). Decode rates are
compared with W1 only at equal sampling (`runner.summarize`).
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator
from tqdm import tqdm

from workloads.client import TurnResult
from workloads.runner import WorkloadResult, summarize


def _f(x: float | None, nd: int = 1) -> str:
    return "—" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown(results: dict[str, WorkloadResult]) -> str:
    lines = ["# Workload replay", ""]
    summ = summarize(results)
    lines += [("| workload | version | api | turns | errors | wall s | mean decode tok/s | "
              "sampling | W1 at that sampling tok/s | vs W1 |"),
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = summ[name]
        other = s["stability_vs_w1_other_sampling"]
        vs = (_f(s["stability_vs_w1"], 3) if s["stability_vs_w1"] is not None else
              f"— (W1 at {', '.join(s['w1_sampling'])}: {_f(other, 3)}, not comparable)"
              if other is not None else "—")
        lines.append(f"| {name} | `{r.version}` | {r.api} | {len(r.turns)} | "
                     f"{sum(t.error is not None for t in r.turns)} | {r.wall_s:.2f} | "
                     f"{_f(s['mean_decode_tps'])} | {'; '.join(s['sampling'])} | "
                     f"{_f(s['w1_same_sampling_tps'])} | {vs} |")
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


def _series(r: WorkloadResult) -> dict[str, list[tuple[int, TurnResult]]]:
    """Turns (1-based launch order) split into main and sub-agent series."""
    out: dict[str, list[tuple[int, TurnResult]]] = {}
    for i, t in enumerate(r.turns, 1):
        out.setdefault("sub-agents" if t.group == "fanout" else "main", []).append((i, t))
    return out


def _panels(results: dict[str, WorkloadResult], n_rows: int = 1, height: float = 3.6):
    fig, axes = plt.subplots(n_rows, len(results), figsize=(4.6 * len(results),
                                                            height * n_rows), squeeze=False)
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes


def _per_turn(results: dict[str, WorkloadResult], attr: str, ylabel: str, path: Path) -> None:
    """One panel per workload (own y axis); main and sub-agent turns as separate series;
    a failed turn is a red x at the bottom of its panel."""
    fig, axes = _panels(results)
    for ax, (name, r) in zip(axes[0], results.items()):
        for label, pts in _series(r).items():
            ok = [(i, getattr(t, attr)) for i, t in pts if getattr(t, attr) is not None]
            if ok:
                ax.plot(*zip(*ok), marker="o", label=label)
        failed = [i for i, t in enumerate(r.turns, 1) if t.error is not None]
        if failed:
            ax.plot(failed, [0] * len(failed), "rx", markersize=9, label="failed")
        ax.set_title(name)
        ax.set_xlabel("turn (launch order)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def new_tokens(r: WorkloadResult) -> list[int | None]:
    """Per turn, the prompt tokens its session had not sent before (prompt - the session's
    previous prompt + output): what any cache must compute; recompute past it is a miss."""
    last: dict[str, int] = {}
    out: list[int | None] = []
    for t in r.turns:
        if t.prompt_tokens is None:
            out.append(None)
            continue
        prev = last.get(t.session)
        out.append(t.prompt_tokens if prev is None else max(t.prompt_tokens - prev, 0))
        last[t.session] = t.prompt_tokens + t.output_tokens
    return out


def _cache(results: dict[str, WorkloadResult], path: Path) -> None:
    """Cached, new (tokens the session never sent before) and missed (recomputed beyond the
    new ones: a cache miss) prompt tokens per turn; failed turns marked."""
    fig, axes = _panels(results)
    for ax, (name, r) in zip(axes[0], results.items()):
        x = range(1, len(r.turns) + 1)
        cached = [t.cached_tokens or 0 for t in r.turns]
        rec = [t.recomputed_tokens or 0 for t in r.turns]
        new = [min(n or 0, c) for n, c in zip(new_tokens(r), rec)]
        miss = [c - n for c, n in zip(rec, new)]
        ax.bar(x, cached, label="cached", color="tab:green")
        ax.bar(x, new, bottom=cached, label="new tokens", color="tab:blue")
        ax.bar(x, miss, bottom=[a + b for a, b in zip(cached, new)], label="cache miss",
               color="tab:red")
        failed = [i for i, t in enumerate(r.turns, 1) if t.error is not None]
        if failed:
            ax.plot(failed, [0] * len(failed), "kx", markersize=9, label="failed")
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
