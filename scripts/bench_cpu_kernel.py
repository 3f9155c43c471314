"""CPU expert kernel vs torch's bf16 path, on fresh experts, beside the host read ceiling.

Ceiling: an all-thread read stream over --read-gb (best of plain and software-prefetched
passes). The rows run in --rounds rounds, each opened by a ceiling stream, so drift of the
machine's bandwidth lands on all rows alike; the table holds medians over rounds. Then for each
T in --tokens: torch's grouped
bf16 F.linear (cpu_experts_torch) and the C++ kernel (with and without its software prefetch),
each on routes that move to a new window of --layer-experts experts every step, cycling through a
pool of --pool-gb (far larger than the LLC, so weights come from DRAM). GB/s counts the unique
expert bytes a step must read; us/layer is the median step.

  python scripts/bench_cpu_kernel.py                      # the GPU machine (16 cores)
  python scripts/bench_cpu_kernel.py --pool-gb 1 --read-gb 0.5 --seconds 0.5 --threads 2
  python scripts/bench_cpu_kernel.py --threads 16,8 --tokens 1,4 --sweep-all --no-torch \
      --interleaved-rows                                  # new vs old decode layout, A/B
  python scripts/bench_cpu_kernel.py --format fp8 --no-torch   # FP8 / MXFP4 banks (issue 25)

With --format fp8|mxfp4 the pool holds quantized banks and the kernel rows run
freetoken/kernels/cpu/expert_quant.cpp; GB/s counts the quantized bytes (scales included), so "%
ceil" is the kernel's share of the host read bandwidth in quantized bytes (the issue's floor: 85 %).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.experts import calibrate as bw
from freetoken.experts import profile as bwp
from freetoken.kernels.cpu.expert_ops import cpu_experts_torch, run_quant
from freetoken.kernels.cpu.ext import PREFETCH_HINTS, cpu_model, load_kernel
from freetoken.types.model_config import ExpertFormat


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(bwp.SHAPES), default="qwen3.6-35b-a3b")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--format", choices=["dense", "fp8", "mxfp4"], default="dense",
                   help="expert bank format (fp8: 128x128 blocks; dense: --dtype)")
    p.add_argument("--pool-gb", type=float, default=6.0)
    p.add_argument("--read-gb", type=float, default=4.0)
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--threads", default=str(os.cpu_count()),
                   help="comma list; the first is used for the T sweep, the rest at T=1")
    p.add_argument("--layer-experts", type=int, default=None, help="routing window (default E)")
    p.add_argument("--seconds", type=float, default=1.5,
                   help="timed seconds per row, over all rounds")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds over all rows, each opened by a ceiling stream; medians reported")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--sweep-all", action="store_true",
                   help="run the T sweep at every thread count (default: the first only)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch rows")
    p.add_argument("--no-prefetch-rows", action="store_true",
                   help="skip the kernel rows with software prefetch off")
    p.add_argument("--interleaved-rows", action="store_true",
                   help="also time the previous decode layout (interleaved tiles, all threads "
                        "on every expert) beside the per-thread contiguous blocks")
    p.add_argument("--pf-dist", type=int, default=32768,
                   help="decode-path prefetch distance in bytes (the kernel's default: 32768)")
    p.add_argument("--hint", choices=PREFETCH_HINTS, default="t1",
                   help="decode-path prefetch target (the kernel's default: t1)")
    p.add_argument("--pf-sweep", default=None, metavar="D1,D2,...",
                   help="also time T=1 at each of these prefetch distances (bytes) ...")
    p.add_argument("--hint-sweep", default=None, metavar="H1,H2,...",
                   help="... with each of these prefetch targets (default: --hint), at every "
                        "thread count of --threads")
    p.add_argument("--timing", action="store_true",
                   help="record where each decode-path call's time goes (adds a few us/call)")
    p.add_argument("--steal-rows", action="store_true",
                   help="also time the decode layout with work stealing off")
    p.add_argument("--pin", action="store_true",
                   help="pin the pool (page-locked, as the runtime store is when a GPU is present)")
    return p.parse_args()


def main() -> int:
    a = _args()
    shape, dtype = bwp.SHAPES[a.shape], getattr(torch, a.dtype)
    if a.format != "dense":
        dtype = ExpertFormat(a.format, 128 if a.format == "fp8" else 32)
    threads = [int(v) for v in a.threads.split(",")]
    tokens = [int(v) for v in a.tokens.split(",")]
    window = a.layer_experts or shape.experts
    kern = load_kernel()
    print(f"[bench] cpu={cpu_model()!r} isa={kern.built_isa if kern else 'torch-only'} "
          f"torch={torch.__version__} threads={threads}", flush=True)

    # the ceiling is the all-thread stream: the most threads asked for
    torch.set_num_threads(max(threads))
    print(f"[bench] host read ceiling over {a.read_gb:g} GB, {max(threads)} threads ...",
          flush=True)
    ceiling = bw.host_read_gbps(a.read_gb * 1e9, threads=max(threads))
    print(f"[bench] ceiling {ceiling:.1f} GB/s; building a {a.pool_gb:g} GB pool ...", flush=True)
    t0 = time.perf_counter()
    gu, dn = bw.make_pool(shape, dtype, a.pool_gb * 1e9, pin=a.pin)  # [P, 2I, H], [P, H, I]
    print(f"[bench] pool: {gu.shape[0]} experts{' pinned' if a.pin else ''} in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)

    def kernel_fn(nth: int, prefetch: bool, contig: bool = True, dist: int = a.pf_dist,
                  hint: str = a.hint, steal: bool = True):
        def fn(x, ids, g, d):
            assert kern is not None
            kern.set_prefetch(prefetch)
            kern.set_contig(contig)
            kern.set_prefetch_distance(dist)
            kern.set_prefetch_hint(hint)
            kern.set_steal(steal)
            out = torch.empty(ids.shape[0], ids.shape[1], g.shape[2])
            if a.format != "dense":
                run_quant(kern, x, ids, g, d, None, out, num_threads=nth)
                return
            if not a.timing:
                kern.run(x, ids, g, d, None, out, num_threads=nth)
                return
            t0 = time.perf_counter_ns()
            kern.run(x, ids, g, d, None, out, num_threads=nth)
            call = time.perf_counter_ns() - t0
            tm = kern.last_timing()
            if tm:  # decode path: (call, max entry, median end, max end, units stolen), ns
                ends = sorted(r[2] for r in tm)
                fn.timing.append((call, max(r[0] for r in tm), ends[len(ends) // 2], ends[-1],
                                  sum(r[3] for r in tm)))
        fn.timing = []
        return fn

    configs: list[tuple[str, int, int, object]] = []
    for t in tokens:
        if not a.no_torch:
            configs.append(("torch bf16 F.linear", t, threads[0], None))
        if kern is not None:
            configs.append(("kernel", t, threads[0], kernel_fn(threads[0], True)))
            if a.interleaved_rows:
                configs.append(("kernel interleaved", t, threads[0],
                                kernel_fn(threads[0], True, False)))
            if not a.no_prefetch_rows:
                configs.append(("kernel no-prefetch", t, threads[0],
                                kernel_fn(threads[0], False)))
            if a.steal_rows:
                configs.append(("kernel no-steal", t, threads[0],
                                kernel_fn(threads[0], True, steal=False)))
    for nth in threads[1:]:
        if kern is not None:
            for t in tokens if a.sweep_all else [1]:
                configs.append(("kernel", t, nth, kernel_fn(nth, True)))
                if a.interleaved_rows:
                    configs.append(("kernel interleaved", t, nth, kernel_fn(nth, True, False)))

    if kern is not None and a.pf_sweep:
        for nth in threads:
            for hint in (a.hint_sweep or a.hint).split(","):
                for dist in (int(v) for v in a.pf_sweep.split(",")):
                    configs.append((f"kernel {hint} pf={dist // 1024}K", 1, nth,
                                    kernel_fn(nth, dist > 0, True, dist, hint)))

    # Rounds: every config once per round, each round opening with a ceiling stream, so drift
    # of the machine's bandwidth (other tenants) lands on all rows alike; medians over rounds.
    steps_of: dict[int, int] = {}
    for i, (name, t, nth, fn) in enumerate(configs):
        torch.set_num_threads(nth)
        call = fn or (lambda x, ids, g, d: cpu_experts_torch(x, ids, g, d))
        calib = bw.fresh_routes(gu.shape[0], window, t, shape.top_k, 4, i)
        _, step_s = bw.time_experts(call, gu, dn, calib, warmup=1)
        steps_of[i] = int(min(4000, max(8, a.seconds / a.rounds / max(step_s, 1e-6))))
    ceilings: list[float] = [ceiling]
    got: dict[int, list[tuple[float, float, float]]] = {i: [] for i in range(len(configs))}
    for rnd in range(a.rounds):
        if rnd:
            torch.set_num_threads(max(threads))
            ceilings.append(bw.host_read_gbps(a.read_gb * 1e9, repeats=2, threads=max(threads)))
        for i, (name, t, nth, fn) in enumerate(configs):
            torch.set_num_threads(nth)
            call = fn or (lambda x, ids, g, d: cpu_experts_torch(x, ids, g, d))
            routes = bw.fresh_routes(gu.shape[0], window, t, shape.top_k, steps_of[i],
                                     1000 * rnd + i)
            gbps, med = bw.time_experts(call, gu, dn, routes)
            uniq = sum(int(r.unique().numel()) for r in routes) / len(routes)
            got[i].append((gbps, med, uniq))
            print(f"[bench] round {rnd + 1}/{a.rounds} {name:<20} T={t:<2} thr={nth:<3} "
                  f"{gbps:6.1f} GB/s {med * 1e6:8.0f} us/layer  steps={steps_of[i]}", flush=True)
        print(f"[bench] round {rnd + 1}/{a.rounds} ceiling {ceilings[-1]:.1f} GB/s", flush=True)

    def median(v: list[float]) -> float:
        v = sorted(v)
        return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2

    ceiling = median(ceilings)
    fmt_name = a.dtype if a.format == "dense" else a.format
    rows = []
    for i, (name, t, nth, _) in enumerate(configs):
        g = [x[0] for x in got[i]]
        rows.append({"impl": name, "T": t, "threads": nth, "unique": median([x[2] for x in got[i]]),
                     "us": median([x[1] for x in got[i]]) * 1e6, "gbps": median(g),
                     "gbps_min": min(g), "gbps_max": max(g), "pct": 100 * median(g) / ceiling})
    base = {r["T"]: r["gbps"] for r in rows if r["impl"].startswith("torch")}
    print(f"\nceiling (all-thread read stream, median of {len(ceilings)} rounds; range "
          f"{min(ceilings):.1f}-{max(ceilings):.1f}): {ceiling:.1f} GB/s   shape={a.shape} "
          f"dtype={fmt_name} expert={shape.expert_bytes(dtype) / 1e6:.2f} MB pool={a.pool_gb:g} GB"
          f"{' pinned' if a.pin else ''}{' THP' if os.environ.get('THP_MEM_ALLOC_ENABLE') else ''}")
    print(f"{'impl':<22}{'T':>3}{'thr':>5}{'uniq':>7}{'us/layer':>10}{'GB/s':>8}{'range':>13}"
          f"{'% ceil':>8}{'x torch':>9}")
    for r in rows:
        sp = r["gbps"] / base[r["T"]] if r["T"] in base else float("nan")
        rng = f"{r['gbps_min']:.0f}-{r['gbps_max']:.0f}"
        print(f"{r['impl']:<22}{r['T']:>3}{r['threads']:>5}{r['unique']:>7.1f}{r['us']:>10.0f}"
              f"{r['gbps']:>8.1f}{rng:>13}{r['pct']:>8.1f}{sp:>9.2f}")
    if a.timing:
        print("\nwhere a decode-path call's time goes (means over all timed calls, us): entry = "
              "until the last thread entered the parallel region; end = a thread finishing its "
              "last unit")
        print(f"{'impl':<22}{'T':>3}{'thr':>5}{'call':>8}{'entry':>8}{'median end':>12}"
              f"{'last end':>10}{'stolen':>8}")
    for i, (name, t, nth, fn) in enumerate(configs):
        tm = getattr(fn, "timing", None)
        if not tm:
            continue
        m = [sum(r[k] for r in tm) / len(tm) for k in range(5)]
        rows[i]["timing_us"] = {"call": m[0] / 1e3, "entry": m[1] / 1e3, "median_end": m[2] / 1e3,
                                "last_end": m[3] / 1e3, "stolen_units": m[4]}
        print(f"{name:<22}{t:>3}{nth:>5}{m[0] / 1e3:>8.0f}{m[1] / 1e3:>8.1f}{m[2] / 1e3:>12.0f}"
              f"{m[3] / 1e3:>10.0f}{m[4]:>8.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"ceiling": ceiling, "ceilings": ceilings,
                                             "pin": a.pin,
                                             "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
                                             "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
