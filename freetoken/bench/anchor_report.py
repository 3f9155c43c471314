"""`ft bench anchors` results: per budget, per scope (the traces interleaved as concurrent
sessions, then each trace alone), the unavoidable minimum, each policy's recompute, its ratio
to the minimum, and the excess ratio against each imitated baseline.

Turns: every request but each trace's first (a trace's first request has nothing of its own
to reuse; placement decides the rest). A scope with no such turn (a one-request trace) reports
its recompute and minimum over all requests and no ratio. Excess = recomputed - minimum; the
excess ratio of a policy against a baseline is the baseline's excess over the policy's
(`at min` where the baseline already is at the minimum, `inf` where only the policy is).
"""
from __future__ import annotations

BASELINES = ("upstream", "llamacpp")


def excess_ratio(ours: int, base: int) -> float | str:
    if base <= 0:
        return "at min"
    if ours <= 0:
        return "inf"
    return round(base / ours, 2)


def scope_result(per_policy: dict[str, dict]) -> dict:
    """One scope's figures from `SimResult.summary()` per policy (same requests each)."""
    any_ = next(iter(per_policy.values()))
    turns = any_["turns"]
    key_rec, key_min = ("recomputed", "unavoidable") if turns else ("recomputed_all",
                                                                   "unavoidable_all")
    minimum = any_[key_min]
    out: dict = {"requests": any_["requests"], "turns": turns, "minimum": minimum,
                 "minimum_all": any_["unavoidable_all"], "policies": {}}
    excess = {name: r[key_rec] - minimum for name, r in per_policy.items()}
    for name, r in per_policy.items():
        row = {"recomputed": r[key_rec], "recomputed_all": r["recomputed_all"],
               "excess": excess[name], "evicted": r["evicted"], "spilled": r["spilled"],
               "restored": r["restored"], "snapshot_bytes": r["snapshot_bytes"]}
        if turns:
            row["ratio"] = round(r[key_rec] / max(minimum, 1), 4)
        for b in BASELINES:
            if b in excess and name not in BASELINES:
                row[f"excess_ratio_{b}"] = excess_ratio(excess[name], excess[b])
        out["policies"][name] = row
    return out


def print_scope(name: str, res: dict) -> None:
    n, t = res["requests"], res["turns"]
    if t:
        print(f"  {name}: {n} requests ({t} turns after the first); minimum {res['minimum']} "
              f"tokens over the turns ({res['minimum_all']} with the first)")
    else:
        print(f"  {name}: {n} request(s), no later turn: recompute over all requests, "
              f"minimum {res['minimum']} (no ratio)")
    cols = [b for b in BASELINES if b in res["policies"]]
    head = f"    {'policy':<15}{'recomputed':>11}{'excess':>9}"
    head += f"{'ratio':>8}" if t else ""
    head += "".join(f"{'vs ' + b:>13}" for b in cols)
    print(head + f"{'evicted':>9}{'spilled':>9}{'restored':>9}")
    for pol, r in res["policies"].items():
        line = f"    {pol:<15}{r['recomputed']:>11}{r['excess']:>9}"
        line += f"{r['ratio']:>8}" if t else ""
        line += "".join(f"{r.get('excess_ratio_' + b, '-')!s:>13}" for b in cols)
        print(line + f"{r['evicted']:>9}{r['spilled']:>9}{r['restored']:>9}")
