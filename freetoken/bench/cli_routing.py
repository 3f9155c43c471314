"""`ft bench routing`: replay a routing trace through expert-cache policies at equal capacity.

Prints one row per capacity (fraction of the L*E expert pool held on the GPU) with the miss
rate of each policy (see replay.py), beside `uniform` = 1 - capacity, the miss rate any fixed
set would have if routing were uniform and independent (the no-locality reference).
"""
from __future__ import annotations

import argparse
import json
import time

from freetoken.bench.replay import POLICIES, replay
from freetoken.bench.routing import SYNTH_LOCALITY_QWEN36, calibrate_locality, synthetic_routing
from freetoken.bench.routing_trace import RoutingTrace, load_trace
from freetoken.log import get_logger, kv

log = get_logger("experts")

DEFAULT_CAPACITIES = "0.1,0.2,0.3,0.37,0.4,0.5,0.6,0.7,0.8,0.9,1.0"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("routing", help="replay routing traces through expert-cache policies")
    p.add_argument("--trace", default="shared",
                   help="shared | synthetic | a recorder .npz | a directory in the shared layout")
    p.add_argument("--capacities", default=DEFAULT_CAPACITIES,
                   help="comma-separated fractions of the expert pool")
    p.add_argument("--lru-impl", choices=["fast", "reference", "triton"], default="fast",
                   help="fast: exact Python model of the decision; reference/triton: the real one")
    p.add_argument(
        "--device", default="cpu", help="device of the residency table (reference/triton)"
    )
    p.add_argument("--max-sequences", type=int, default=None)
    syn = p.add_argument_group("synthetic trace (Qwen3.6-sized pool: 40 layers x 256, top-8)")
    syn.add_argument("--locality", type=float, default=SYNTH_LOCALITY_QWEN36)
    syn.add_argument("--steps", type=int, default=1024, help="decode steps")
    syn.add_argument("--prompt-tokens", type=int, default=256)
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--calibrate", action="store_true",
                     help="re-run the locality calibration (37%% capacity -> 16%% LRU misses)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _trace(args: argparse.Namespace) -> RoutingTrace:
    if args.trace != "synthetic":
        return load_trace(args.trace)
    locality = args.locality
    if args.calibrate:
        locality = calibrate_locality()
        log.info(kv("calibrated", locality=locality, constant=SYNTH_LOCALITY_QWEN36))
    return synthetic_routing(40, 256, 8, args.steps, locality, args.prompt_tokens, args.seed)


def run(args: argparse.Namespace) -> int:
    trace = _trace(args)
    pool = trace.num_layers * trace.num_experts
    capacities = [float(c) for c in args.capacities.split(",") if c.strip()]
    rows = []
    t0 = time.perf_counter()
    for cap in capacities:
        slots = round(cap * pool)
        row: dict[str, float | int] = {"capacity": cap, "slots": slots, "uniform": 1.0 - cap}
        for policy in POLICIES:
            row[policy] = replay(trace, policy, slots, args.lru_impl, args.device,
                                 args.max_sequences)
        rows.append(row)
        log.debug(kv("routing_row", **row))
    info = {
        "trace": trace.name,
        "sequences": trace.num_sequences if args.max_sequences is None
        else min(args.max_sequences, trace.num_sequences),
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "decode_steps": int(trace.decode.shape[1]),
        "prompt_tokens": 0 if trace.prefill is None else int(trace.prefill.shape[2]),
        "lru_impl": args.lru_impl,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        print(json.dumps({**info, "rows": rows}, indent=1))
        return 0
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    header = ["capacity", "slots", *POLICIES, "uniform"]
    print("  ".join(f"{h:>13}" for h in header))
    for row in rows:
        cells = [f"{row['capacity']:.0%}", str(row["slots"])]
        cells += [f"{row[p]:.1%}" for p in (*POLICIES, "uniform")]
        print("  ".join(f"{c:>13}" for c in cells))
    return 0
