"""`ft bench elastic`: decode tok/s before, during and after an elastic-VRAM shrink and grow.

The issue #24 goal on the H200: decode streams keep running while the budget shrinks by 6 GB
mid-session (another process claims it) and grows back; no request fails and the rate
recovers within 10 % after the rebuild. This runs `--batch` greedy streams through
`EngineCore` (the engine `ft serve` runs, its decode runner and graphs included) and, after
`--phase-tokens` tokens per stream in each phase, asks the elastic planner for a reading of
`--shrink` bytes less free memory than the margin (rule *memory claimed*: the expert cache
pays first), then for the same bytes back (*memory returned*). It prints one row per phase:
tokens, seconds, tok/s, the expert-cache hit rate and the bytes the link moved per second
beside the sizes, the rebuilds' milliseconds, and the recovery ratio.

The rows of the phase right after a rebuild include the graphs captured again (each bucket at
its next step): `shrunk` is the rate at the smaller budget, `regrown` the recovery figure.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from freetoken.cli.options import add_moe_args, parse_bytes_arg

    p = sub.add_parser("elastic", help="decode tok/s before/during/after an elastic-VRAM "
                                       "shrink and grow")
    p.add_argument("--model", default=None, help="checkpoint directory (or --shape)")
    p.add_argument("--shape", default=None, help="a real shape (qwen3.6-35b-a3b) built with "
                                                 "random weights in memory")
    p.add_argument("--layers", type=int, default=None, help="cut the shape to N layers")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=4, help="streams decoding together")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--phase-tokens", type=int, default=64, help="tokens per stream per phase")
    p.add_argument("--shrink", type=parse_bytes_arg, default=6 * 2**30, metavar="BYTES",
                   help="device memory claimed mid-session, then given back (default 6G)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    add_moe_args(p)
    p.set_defaults(func=run)


def _build(args):
    """(model, runtime, device) for `--model DIR` or `--shape S --layers N`."""
    import dataclasses

    import torch

    from freetoken.cli.options import moe_options, resolve_device, resolve_dtype
    from freetoken.experts.runtime import MoERuntime

    device = torch.device(resolve_device(args.device))
    dtype = resolve_dtype(args.dtype)
    opts = moe_options(args, args.moe_backend or "offload")
    if opts.cache_size is None and opts.cache_rate is None and opts.cache_mem is None:
        opts = dataclasses.replace(opts, cache_rate=0.37)  # the consumer-GPU setting
    if args.shape:
        from freetoken.bench.random_model import random_model
        from freetoken.experts.store import ExpertStore
        from freetoken.types.presets import preset_config

        cfg = preset_config(args.shape, args.layers)
        model = random_model(cfg, dtype or torch.bfloat16, device)
        blocks = model.moe_blocks()
        store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                            [b.experts.down_proj.data for b in blocks],
                            pin=device.type == "cuda")
        for b in blocks:
            b.experts.release_banks()  # the store holds the copy
        return model, MoERuntime.build(model, opts, device, store=store), device
    if not args.model:
        raise SystemExit("ft bench elastic: give --model DIR or --shape NAME")
    from freetoken.models.loader import place_model, read_model

    # (cli/build.py `load_with_experts`'s composition; bench imports no cli module but options)
    t0 = time.perf_counter()
    model = read_model(args.model, dtype, str(device), progress=False)
    rt = MoERuntime.build(model, opts, device)
    model = place_model(model, device, cpu_kernels=rt.computes_on_cpu,
                        name=Path(args.model).name, started=t0)
    return model, rt, device


def run(args: argparse.Namespace) -> int:
    rows = bench(args)
    print_rows(rows)
    return 0 if rows[-1]["ok"] else 1


def bench(args: argparse.Namespace) -> list[dict]:
    """The phases' rows (see the module docstring); the last row is the summary."""
    import torch

    from freetoken.engine.core import EngineCore
    from freetoken.engine.elastic import ElasticVram
    from freetoken.engine.vram_plan import VramKnobs
    from freetoken.types.api import GenerateRequest, SamplingParams

    model, rt, device = _build(args)
    if rt is None or rt.cache is None:
        raise SystemExit("ft bench elastic: needs an expert slot cache (--moe-backend "
                         "offload|hybrid|cpu|auto)")
    B, P, N = args.batch, args.prompt_tokens, args.phase_tokens
    total = 3 * N + 16  # (streams a step or two apart at the start, and a step in flight)
    core = EngineCore(model, [], kv_tokens=B * (P + total) + 64, state_slots=2 * B + 4,
                      max_running=B, chunk_tokens=max(512, P), decode_runner=True,
                      cuda_graph=args.cuda_graph, moe=rt)
    if core.runner is not None:  # one attention plan timed: flashinfer's build ends first
        core.runner.finish_build()
    start_slots = rt.cache.num_slots
    # (a hysteresis band under the claim, so that a small --shrink on a small model re-plans)
    knobs = VramKnobs(hysteresis_bytes=min(VramKnobs().hysteresis_bytes, args.shrink // 4))
    el = ElasticVram(core, knobs=knobs, max_expert_slots=start_slots)
    g = torch.Generator().manual_seed(0)
    V = model.cfg.vocab_size
    got = [0] * B
    done: list[str | None] = [None] * B

    def on(i: int):
        def emit(ev) -> None:
            got[i] += len(ev.token_ids)
            if ev.finished:
                done[i] = ev.finish_reason
        return emit

    for i in range(B):
        ids = torch.randint(0, V, (P,), generator=g).tolist()
        core.add(GenerateRequest(ids, SamplingParams(max_tokens=total, temperature=0.0,
                                                     ignore_eos=True), request_id=f"e{i}"), on(i))
    while core.has_work() and min(got) == 0:  # prefill and first tokens: not timed
        core.step()
    rows: list[dict] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def phase(name: str) -> None:
        until = min(got) + N  # every stream decodes at least N tokens in the phase
        rt.counters.sync()
        c0 = dict(rt.counters.as_dict())
        sync()
        t0, n0 = time.perf_counter(), sum(got)
        while core.has_work() and min(got) < until:
            core.step()
        sync()
        dt = time.perf_counter() - t0
        rt.counters.sync()
        c1 = rt.counters.as_dict()
        hits, misses = (c1[k] - c0[k] for k in ("hits", "misses"))
        rows.append({"phase": name, "tokens": sum(got) - n0, "seconds": dt,
                     "tok_s": (sum(got) - n0) / dt if dt > 0 else 0.0,
                     "hit": hits / max(1, hits + misses),
                     "fetch_gbps": (c1["fetch_bytes"] - c0["fetch_bytes"]) / max(dt, 1e-9) / 1e9,
                     "expert_slots": el.expert_slots, "kv_tokens": el.kv_tokens})

    def rebuild(name: str, free: int) -> None:
        sync()
        t0 = time.perf_counter()
        out = el.replan(free)
        sync()
        rows.append({"phase": name, "seconds": time.perf_counter() - t0,
                     "ms": out["ms"] if out else None, "expert_slots": el.expert_slots,
                     "kv_tokens": el.kv_tokens, "reason": out["reason"] if out else "none"})

    margin = el.knobs.margin_bytes
    phase("before")
    rebuild("rebuild_shrink", margin - args.shrink)
    phase("shrunk")
    # the bytes back (plus one slot: the claim was paid in whole slots, rounded up); the
    # growth stops at the starting budget (`max_expert_slots`)
    rebuild("rebuild_grow", margin + args.shrink + rt.store.expert_bytes)
    phase("regrown")
    while core.has_work():
        core.step()
    core.close()  # the CPU bridge's workers, the state host tier's fill
    before, after = rows[0]["tok_s"], rows[4]["tok_s"]
    ok = all(d == "length" for d in done) and all(n == total for n in got)
    rows.append({"phase": "summary", "recovery": after / before if before else 0.0,
                 "shrunk_ratio": rows[2]["tok_s"] / before if before else 0.0,
                 "slots_start": start_slots, "slots_shrunk": rows[1]["expert_slots"],
                 "slot_mb": rt.store.expert_bytes / 2**20, "ok": ok,
                 "failed": [f"e{i}:{d}" for i, d in enumerate(done) if d != "length"]})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'phase':16} {'tokens':>7} {'seconds':>8} {'tok/s':>9} {'hit':>6} "
          f"{'fetch GB/s':>10} {'slots':>7} {'kv':>8}")
    for r in rows[:-1]:
        if "tokens" in r:
            print(f"{r['phase']:16} {r['tokens']:7d} {r['seconds']:8.3f} {r['tok_s']:9.1f} "
                  f"{r['hit']:6.2f} {r['fetch_gbps']:10.2f} {r['expert_slots']:7d} "
                  f"{r['kv_tokens']:8d}")
        else:
            print(f"{r['phase']:16} {'':7} {r['seconds']:8.3f} {'':9} {'':6} {'':10} "
                  f"{r['expert_slots']:7d} {r['kv_tokens']:8d}  ({r['reason']}, "
                  f"rebuild {r['ms']} ms)")
    s = rows[-1]
    given = (s["slots_start"] - s["slots_shrunk"]) * s["slot_mb"]
    print(f"expert slots {s['slots_start']} -> {s['slots_shrunk']} -> back "
          f"({given:.1f} MiB of slots given up); shrunk/before {s['shrunk_ratio']:.3f}; "
          f"recovery regrown/before {s['recovery']:.3f} (goal >= 0.90); "
          f"requests failed: {len(s['failed'])} {' '.join(s['failed'])}")
