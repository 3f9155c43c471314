"""`ft bench anchors`: snapshot placement policies compared on real and generated agent traffic.

Sources: recorded harness traces (`--traces FILE|DIR ...`; several files are interleaved
round-robin as concurrent sessions; each file is one session, its sub-agents share its head)
and generated workloads (`--workloads W2,W3,W4`, each session of a workload its own session,
all interleaved). Every request goes through the real renderer (the API mapping, the chat
template, anchor detection) and `anchor_sim.replay`, per policy, at the same device and host
slot budgets. Prints recomputed prefill tokens per turn beside the unavoidable minimum.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from freetoken.bench.anchor_sim import SimRequest, replay
from freetoken.chat import ChatTokenizer, anthropic_to_template, openai_to_template
from freetoken.chat.errors import ChatInputError

# Qwen3.6-35B-A3B: 30 gated-DeltaNet layers x (fp32 ssm 32 heads x 128 x 128 = 2 MiB + bf16 conv
# 8192 channels x 3 = 48 KiB)
QWEN36_SLOT_BYTES = 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
POLICIES = ["semantic", "semantic+cuts", "interval:4096", "end_only", "upstream", "llamacpp"]
DEFAULT_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "harness_traces"


Predictor = Callable[[Any, list, list], list[int]]


def adapter_cuts(req: Any, anchors: list, messages: list) -> list[int]:
    """The proxy's prediction: the adapter that claims `req`, its `cut_points`."""
    from harness_adapters import detect_adapter

    return list(detect_adapter(req).cut_points(anchors, messages))


def _render(tok: ChatTokenizer, path: str, body: dict[str, Any], headers: dict[str, str],
            session: str, predictor: Predictor | None, heads: Any = None) -> SimRequest:
    """One request as the engine receives it. `heads` (a `proxy.heads.HeadBreaks`): add the
    `system_block` anchors the native proxy adds at the claiming adapter's head breaks."""
    api = "anthropic" if path.startswith("/v1/messages") else "openai"
    ti = (anthropic_to_template if api == "anthropic" else openai_to_template)(body)
    p = tok.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking)
    cuts, anchors = None, p.anchors
    if predictor is not None or heads is not None:
        from harness_adapters import HarnessRequest, detect_adapter
        from harness_adapters.base import system_text

        req = HarnessRequest(api, path, {k.lower(): v for k, v in headers.items()}, body)
        if predictor is not None:
            cuts = predictor(req, p.anchors, ti.messages)
        if heads is not None:
            breaks = detect_adapter(req).head_breaks(body)
            anchors = heads.anchors(anchors, system_text(body), breaks, p.input_ids)
    return SimRequest(session, p.input_ids, anchors, cuts=cuts)


def _fill_gen(reqs: list[SimRequest], im_end: int) -> None:
    """Generated tokens: where the session's next request extends this prompt, the tokens up
    to its `<|im_end|>` (what the model produced and the engine fed back); else 32 fresh ones."""
    fresh = 10**9
    last: dict[str, SimRequest] = {}
    for r in reqs:
        prev = last.get(r.session)
        if prev is not None and not prev.gen:
            n = len(prev.ids)
            if r.ids[:n] == prev.ids and len(r.ids) > n:
                tail = r.ids[n:]
                prev.gen = tail[: tail.index(im_end)] if im_end in tail else tail
        last[r.session] = r
    for r in reqs:
        if not r.gen:
            r.gen = list(range(fresh, fresh + 32))
            fresh += 32


def load_trace(tok: ChatTokenizer, path: Path, session: str,
               predictor: Predictor | None = None, heads: Any = None,
               edit: Callable[[dict], dict] | None = None) -> list[SimRequest]:
    """A recorded session's requests rendered (`_render`); `edit` rewrites each body first
    (e.g. the same session started in another directory)."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        body = rec.get("body")
        if "count_tokens" in rec.get("path", "") or not isinstance(body, dict) \
                or "messages" not in body:
            continue
        if edit is not None:
            body = edit(body)
        try:
            out.append(_render(tok, rec["path"], body, rec.get("headers", {}), session,
                               predictor, heads))
        except ChatInputError:
            continue
    return out


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


def interleave(streams: list[list[SimRequest]]) -> list[SimRequest]:
    out, i = [], 0
    while any(i < len(s) for s in streams):
        out += [s[i] for s in streams if i < len(s)]
        i += 1
    return out


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
                   help="trace files or dirs (default: ../shared/harness_traces, all files)")
    p.add_argument("--workloads", default="", help="generated workloads, e.g. W2,W3,W4")
    p.add_argument("--scale", choices=("tiny", "full"), default="full")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--state-slots", type=int, default=64, help="device snapshot slots")
    p.add_argument("--host-slots", type=int, default=256, help="host-tier snapshot slots")
    p.add_argument("--slot-bytes", type=int, default=QWEN36_SLOT_BYTES)
    p.add_argument("--cut-points", default=None, metavar="MODULE:FUNC",
                   help="predictor for semantic+cuts: (request, anchors, messages) -> positions "
                        "(default: the harness adapters')")
    p.add_argument("--head-breaks", action=argparse.BooleanOptionalAction, default=True,
                   help="`system_block` anchors at the harness adapters' head breaks, as the "
                        "native proxy sends them (--no-head-breaks: the template's anchors only)")
    p.add_argument("--json", action="store_true", help="one JSON object, figures per policy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    tok = ChatTokenizer.from_dir(_tokenizer_dir())
    predictor = load_predictor(args.cut_points) if "semantic+cuts" in args.policies else None
    heads = head_breaks(tok) if args.head_breaks else None
    streams: list[list[SimRequest]] = []
    if args.traces is not None or not args.workloads:
        paths = [Path(x) for x in (args.traces or [str(DEFAULT_TRACES)])]
        files = [f for p in paths for f in (sorted(p.glob("*/*.jsonl")) + sorted(p.glob("*.jsonl"))
                                             if p.is_dir() else [p])]
        streams += [load_trace(tok, f, f.stem, predictor, heads) for f in files]
    for name in filter(None, args.workloads.split(",")):
        streams += load_workload(tok, name.strip(), args.scale, predictor, heads)
    reqs = interleave(streams)
    _fill_gen(reqs, tok.special_ids["<|im_end|>"])
    res = run_bench(reqs, args.policies.split(","), args.state_slots, args.host_slots,
                    args.slot_bytes)
    if args.json:
        print(json.dumps({"sessions": len(streams), "requests": len(reqs),
                          "state_slots": args.state_slots, "host_slots": args.host_slots,
                          "slot_bytes": args.slot_bytes, "policies": res}))
        return 0
    print(f"{len(streams)} sessions, {len(reqs)} requests, {sum(len(r.ids) for r in reqs)} "
          f"prompt tokens; budget {args.state_slots} device + {args.host_slots} host slots of "
          f"{args.slot_bytes / 2**20:.1f} MiB")
    print("per turn after each session's first; all: every request, first ones included")
    print(f"{'policy':<15}{'recomp/turn':>12}{'floor/turn':>11}{'ratio':>8}{'excess/turn':>12}"
          f"{'snap GiB':>10}"
          f"{'evicted':>9}{'spilled':>9}{'restored':>9}{'all recomp':>11}{'all floor':>10}")
    for name, r in res.items():
        print(f"{name:<15}{r['recomputed_per_turn']:>12}{r['unavoidable_per_turn']:>11}"
              f"{r['ratio']:>8}{r['avoidable_per_turn']:>12}"
              f"{r['snapshot_bytes'] / 2**30:>10.1f}{r['evicted']:>9}"
              f"{r['spilled']:>9}{r['restored']:>9}{r['recomputed_all']:>11}"
              f"{r['unavoidable_all']:>10}")
    return 0


def _tokenizer_dir() -> Path:
    from freetoken.chat import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir()
