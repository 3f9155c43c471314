"""`ft bench anchors`: snapshot placement policies compared on real and generated agent traffic.

Sources: recorded harness traces (`--traces FILE|DIR ...`, `bench/traces.py`: each file one
trace, Chat, Anthropic and Responses bodies; its requests' sessions and sub-agents from the
harness adapters, as the proxy sends them) and generated workloads (`--workloads W2,W3,W4`,
each session of a workload its own stream). Every request goes through the real renderer (the
API mapping, the chat template, anchor detection) and `anchor_sim.replay`, per policy, at each
`--budget DEVICE+HOST` (repeatable: a sweep). Results (`anchor_report.py`) per budget: the
streams interleaved round-robin as concurrent sessions, then each alone; per scope the
unavoidable minimum, each policy's recompute, ratio and excess ratio against each imitated
baseline. A trace that cannot be read faithfully is an error naming the record (exit 2).

Like the native proxy, each request gets a `system_block` anchor at each of its harness
adapter's head breaks (where another session may part from this one inside the system text:
the working directory, the date); `--no-head-breaks` replays the template's anchors only.

Predicted cut points (`semantic+cuts`) come from the agent proxy's harness adapters by default
(`harness_adapters.detect_adapter(request).cut_points(anchors, messages)`, what the proxy sends
the engine), or from `--cut-points MODULE:FUNC`, a function `(request, anchors, messages) ->
positions` with `request` a `harness_adapters.HarnessRequest`; without either, `semantic+cuts`
is not run.
"""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from freetoken.bench.anchor_report import scope_result
from freetoken.bench.anchor_sim import SimRequest, replay
from freetoken.bench.traces import (
    Predictor,
    TraceError,
    _render,
    attribute_replies,
    interleave,
    load_trace,
)
from freetoken.chat import ChatTokenizer
from freetoken.envs import harness_traces_dir

# Qwen3.6-35B-A3B: 30 gated-DeltaNet layers x (fp32 ssm 32 heads x 128 x 128 = 2 MiB + bf16 conv
# 8192 channels x 3 = 48 KiB)
QWEN36_SLOT_BYTES = 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
POLICIES = ["semantic", "semantic+cuts", "interval:4096", "end_only", "upstream", "llamacpp"]


def adapter_cuts(req: Any, anchors: list, messages: list) -> list[int]:
    """The proxy's prediction: the adapter that claims `req`, its `cut_points`."""
    from harness_adapters import detect_adapter

    return list(detect_adapter(req).cut_points(anchors, messages))


def load_workload(tok: ChatTokenizer, name: str, scale: str,
                  predictor: Predictor | None = None, heads: Any = None
                  ) -> list[list[SimRequest]]:
    from workloads.registry import build_workload

    w = build_workload(name, scale)  # type: ignore[arg-type]
    path = "/v1/messages" if w.api == "anthropic" else "/v1/chat/completions"
    per: dict[str, list[SimRequest]] = {}
    for t in w.turns:
        per.setdefault(t.session, []).append(
            _render(tok, path, t.body, t.headers, f"{name}/{t.session}", predictor, heads))
    return list(per.values())


def head_breaks(tok: ChatTokenizer) -> Any:
    """The native proxy's head-break anchoring (`proxy.heads.HeadBreaks`), or None where the
    harness adapters are not installed."""
    try:
        importlib.import_module("harness_adapters")
    except ImportError:
        return None
    from freetoken.proxy.heads import HeadBreaks

    return HeadBreaks(tok)


def load_predictor(spec: str | None) -> Predictor | None:
    if not spec:
        try:
            importlib.import_module("harness_adapters")
        except ImportError:
            return None
        return adapter_cuts
    mod_name, _, func = spec.partition(":")
    return getattr(importlib.import_module(mod_name), func or "cut_points")


def run_bench(reqs: list[SimRequest], policies: list[str], device_slots: int, host_slots: int,
              slot_bytes: int = QWEN36_SLOT_BYTES) -> dict[str, dict]:
    out = {}
    for spec in policies:
        if spec == "semantic+cuts" and any(r.cuts is None for r in reqs):
            continue
        out[spec] = replay(reqs, spec, device_slots, host_slots).summary(slot_bytes)
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("anchors", help="snapshot policies on agent traffic (no model)")
    p.add_argument("--traces", nargs="*", default=None,
                   help="trace files or dirs (default: tests/data/harness_traces, all files)")
    p.add_argument("--workloads", default="", help="generated workloads, e.g. W2,W3,W4")
    p.add_argument("--scale", choices=("tiny", "full"), default="full")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--budget", action="append", default=None, metavar="DEVICE+HOST",
                   help="snapshot slots on the device and in the host tier, e.g. 16+32; "
                        "repeat to sweep (default: 64+256)")
    p.add_argument("--state-slots", type=int, default=None,
                   help="device snapshot slots (one budget with --host-slots; see --budget)")
    p.add_argument("--host-slots", type=int, default=None, help="host-tier snapshot slots")
    p.add_argument("--no-single", action="store_true",
                   help="the interleaved replay only, not each trace alone")
    p.add_argument("--slot-bytes", type=int, default=QWEN36_SLOT_BYTES)
    p.add_argument("--cut-points", default=None, metavar="MODULE:FUNC",
                   help="predictor for semantic+cuts: (request, anchors, messages) -> positions "
                        "(default: the harness adapters')")
    p.add_argument("--head-breaks", action=argparse.BooleanOptionalAction, default=True,
                   help="`system_block` anchors at the harness adapters' head breaks, as the "
                        "native proxy sends them (--no-head-breaks: the template's anchors only)")
    p.add_argument("--json", action="store_true", help="one JSON object, figures per policy")
    p.set_defaults(func=run)


def parse_budget(spec: str) -> tuple[int, int]:
    """`16+32` -> (16, 32); `16` -> (16, 0)."""
    dev, _, host = spec.partition("+")
    try:
        d, h = int(dev), int(host or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget {spec!r}: want DEVICE+HOST, e.g. 16+32") \
            from None
    if d < 1 or h < 0:
        raise argparse.ArgumentTypeError(f"--budget {spec!r}: device >= 1, host >= 0 slots")
    return d, h


def budgets(args: argparse.Namespace) -> list[tuple[int, int]]:
    out = [parse_budget(b) for b in args.budget or []]
    if args.state_slots is not None or args.host_slots is not None or not out:
        out.append((args.state_slots or 64, 256 if args.host_slots is None
                    else args.host_slots))
    return list(dict.fromkeys(out))


def trace_files(specs: list[str] | None) -> list[Path]:
    # default: the recorded traces of the checkout (envs.harness_traces_dir)
    paths = [Path(x) for x in specs] if specs else [harness_traces_dir()]
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(p.glob("*/*.jsonl")) + sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise TraceError(f"{p}: no such trace file or directory")
    return files


def bench_scopes(streams: dict[str, list[SimRequest]], policies: list[str], device: int,
                 host: int, slot_bytes: int, single: bool = True) -> dict[str, dict]:
    """`interleaved` (every stream as concurrent sessions) and, with `single`, each alone."""
    scopes = {"interleaved": interleave(list(streams.values()))}
    if single and len(streams) > 1:
        scopes.update(streams)
    return {name: scope_result(run_bench(reqs, policies, device, host, slot_bytes))
            for name, reqs in scopes.items()}


def run(args: argparse.Namespace) -> int:
    from freetoken.bench.anchor_report import print_scope

    tok = ChatTokenizer.from_dir(_tokenizer_dir())
    predictor = load_predictor(args.cut_points) if "semantic+cuts" in args.policies else None
    heads = head_breaks(tok) if args.head_breaks else None
    try:
        plan = budgets(args)
        streams: dict[str, list[SimRequest]] = {}
        if args.traces is not None or not args.workloads:
            for f in trace_files(args.traces):
                name = f.stem if f.stem not in streams else f"{f.parent.name}/{f.stem}"
                streams[name] = load_trace(tok, f, name, predictor, heads)
    except (TraceError, argparse.ArgumentTypeError) as e:
        print(f"ft bench anchors: {e}")
        return 2
    for name in filter(None, args.workloads.split(",")):
        for i, s in enumerate(load_workload(tok, name.strip(), args.scale, predictor, heads)):
            streams[f"{name.strip()}/{i}"] = s
    im_end = tok.special_ids["<|im_end|>"]
    for s in streams.values():  # each alone: replies within the stream, by session
        attribute_replies(s, im_end)
    policies = args.policies.split(",")
    results = [{"device_slots": d, "host_slots": h,
                "scopes": bench_scopes(streams, policies, d, h, args.slot_bytes,
                                       not args.no_single)} for d, h in plan]
    if args.json:
        print(json.dumps({"traces": list(streams), "requests": sum(map(len, streams.values())),
                          "slot_bytes": args.slot_bytes, "budgets": results}))
        return 0
    n = sum(map(len, streams.values()))
    print(f"{len(streams)} traces, {n} requests, "
          f"{sum(len(r.ids) for s in streams.values() for r in s)} prompt tokens; "
          f"slots of {args.slot_bytes / 2**20:.1f} MiB")
    for res in results:
        print(f"budget {res['device_slots']} device + {res['host_slots']} host slots")
        for name, sc in res["scopes"].items():
            print_scope(name, sc)
    return 0


def _tokenizer_dir() -> Path:
    from freetoken.chat import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir()
