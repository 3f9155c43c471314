"""`ft bench prefill`: seconds per prefill chunk of a real shape with random weights, streamed
through two layer buffers (experts/streamer.py), beside the link floor and the baselines run in
the same process.

Per prompt size (one chunk = the whole prompt), rows:
  stream          two buffers, resident experts read in place (the default path)
  stream/serial   one buffer: copy and compute serialised (`--no-prefill-overlap`)
  stream/all-link every expert over the link, resident ones too (`--no-moe-prefill-hit-d2d`);
                  its floor is `pool_bytes / B_P`, the design's figure
  experts         the per-expert path (streaming off): misses fetched through the decode cache
  fused           every expert resident on the GPU: the compute-only bound
Floors: bytes the row must move over the link / B_P, B_P measured now (one large pinned copy
and the per-expert fill rate of `ft bench bw`), or taken from the cached profile.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill", help="prefill chunk seconds vs the link floor (streaming)")
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--layers", type=int, default=None, help="cut the shape to N layers")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--tokens", default="4096,8192,16384", help="prompt sizes (one chunk each)")
    p.add_argument("--rows", default="stream,stream/serial,stream/all-link,experts,fused")
    p.add_argument("--repeats", type=int, default=2, help="best of N per row")
    p.add_argument("--ttft", type=int, default=0, metavar="TOKENS",
                   help="also time the first token of a TOKENS-long prompt through the engine "
                        "(`ft serve`'s EngineCore, default chunking), streaming on")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    from freetoken.cli.options import add_moe_args

    add_moe_args(p)
    p.set_defaults(func=run)


def measure_link(store, device, seconds: float = 0.5) -> float:
    """B_P in GB/s: whole-layer copies from the pinned store to the device by the copy
    engine, the streamer's unit and mechanism of transfer (`LayerStreamer._copy_runs`)."""
    import torch

    dst = torch.empty_like(store.gate_up(0), device=device)
    dst.copy_(store.gate_up(0), non_blocking=True)  # warm
    torch.cuda.synchronize(device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(store.gate_up(n % store.num_layers), non_blocking=True)
        n += 1
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    return n * dst.numel() * dst.element_size() / dt / 1e9


def _row_opts(row: str, base):
    if row == "stream":
        return replace(base, prefill_stream="on", prefill_stream_tokens=2)
    if row == "stream/serial":
        return replace(base, prefill_stream="on", prefill_stream_tokens=2, prefill_overlap=False)
    if row == "stream/all-link":
        return replace(base, prefill_stream="on", prefill_stream_tokens=2, prefill_hit_d2d=False)
    if row == "experts":
        return replace(base, prefill_stream="off")
    raise SystemExit(f"--rows: unknown row {row!r}")


def run(args: argparse.Namespace) -> int:
    import torch

    from freetoken.bench.moe import drop_fused, install_backend
    from freetoken.bench.random_model import random_model
    from freetoken.cli.options import moe_options, resolve_device, resolve_dtype
    from freetoken.engine.generate import generate
    from freetoken.experts.runtime import find_profile
    from freetoken.experts.store import ExpertStore
    from freetoken.types.api import SamplingParams
    from freetoken.types.presets import preset_config

    if not args.random_weights:
        raise SystemExit("--random-weights is required (no checkpoint is read)")
    device = torch.device(resolve_device(args.device))
    if device.type != "cuda":
        raise SystemExit("ft bench prefill measures the link: it needs a CUDA device")
    sizes = [int(t) for t in args.tokens.split(",")]
    rows = args.rows.split(",")
    cfg = preset_config(args.shape, args.layers)
    dtype = resolve_dtype(args.dtype) or torch.bfloat16
    model = random_model(cfg, dtype, device)
    blocks = model.moe_blocks()
    store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                        [b.experts.down_proj.data for b in blocks], pin=True)
    for b in blocks:
        b.experts.release_banks()  # the store holds the only copy
    base = moe_options(args, "offload")
    if base.cache_size is None and base.cache_rate is None and base.cache_mem is None:
        base = replace(base, cache_rate=0.37)
    b_p = measure_link(store, device)
    prof = find_profile(model, store.dtype)
    pool = store.nbytes
    print(f"shape={args.shape} layers={cfg.num_layers} experts={pool / 1e9:.2f} GB "
          f"cache_rate={base.cache_rate} B_P={b_p:.1f} GB/s (measured now, whole-layer fills)"
          + (f"; profile B_P={prof.b_p:.1f}" if prof and prof.b_p else ""), flush=True)
    g = torch.Generator().manual_seed(0)

    def prompt_of(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()

    results: dict[tuple[int, str], tuple[float, float]] = {}
    for row in rows:
        if row == "fused":
            if pool > 0.8 * torch.cuda.mem_get_info(device)[0]:
                print("[bench] fused skipped: the pool does not fit on the GPU", flush=True)
                continue
            full = install_backend(model, store, "fused", base, device)
            rt = None
        else:
            full = rt = install_backend(model, store, "offload", _row_opts(row, base), device)
        # kernels compile on a process's first use of each shape class: not in the figures
        generate(model, prompt_of(512), SamplingParams(max_tokens=2, temperature=0.0,
                                                       ignore_eos=True), [], prefill_chunk=512,
                 moe=full)
        if rt is not None:
            rt.counters.sync()
        for T in sizes:
            prompt = prompt_of(T)
            sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            best, moved = float("inf"), 0.0
            for _ in range(max(1, args.repeats)):
                if rt is not None:
                    s0 = rt.counters.stream_bytes + rt.counters.fetch_bytes
                res = generate(model, prompt, sp, [], prefill_chunk=T, moe=full)
                if rt is not None:
                    rt.counters.sync()
                    moved = rt.counters.stream_bytes + rt.counters.fetch_bytes - s0
                best = min(best, res.prefill_seconds)
            results[(T, row)] = (best, moved)
            print(f"[bench] {row:16} {T:6d} tokens: {best:7.3f} s  {T / best:8.0f} tok/s  "
                  f"{moved / 1e9:6.2f} GB over the link", flush=True)
        if row == "fused":
            drop_fused(full, model, device)
    _table(results, sizes, rows, b_p * 1e9, pool)
    if args.ttft:
        rt = install_backend(model, store, "offload", base, device)
        ttft(model, rt, args.ttft, cfg.vocab_size)
    return 0


def ttft(model, rt, tokens: int, vocab: int) -> float:
    """Seconds to the first token of a `tokens`-long prompt through the serving engine, twice:
    on an engine that has run one short request (a first long prompt of the process: what it
    compiles or allocates on the way is in the figure) and again with a new prompt of the same
    length (steady state). Each chunk's seconds are printed beside (the first pass synchronises
    after each chunk to split its device time; the second, whose TTFT is returned, does not,
    and its split is the engine's host-side one); returns the second TTFT."""
    import torch

    from freetoken.engine.core import EngineCore
    from freetoken.engine.sizing import default_chunk_tokens
    from freetoken.types.api import GenerateRequest, SamplingParams

    chunk = default_chunk_tokens(rt)
    core = EngineCore(model, [], kv_tokens=2 * tokens + 64, state_slots=4, max_running=1,
                      chunk_tokens=chunk, moe=rt)
    cuda = model.model.embed_tokens.weight.is_cuda
    # the first decode step of a process captures its graph and compiles kernels (tens of
    # seconds once per process, not per request)
    warm = list(range(10, 10 + min(290, tokens // 2)))
    core.add(GenerateRequest(warm, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                             request_id="warm"), lambda ev: None)
    while core.has_work():
        core.step()
    out = []
    try:
        for k, label in enumerate(("first", "again")):
            prompt = torch.randint(0, vocab, (tokens,),
                                   generator=torch.Generator().manual_seed(1 + k)).tolist()
            got: list[float] = []
            marks: list[float] = []
            t0 = time.perf_counter()
            core.add(GenerateRequest(prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                            ignore_eos=True),
                                     request_id=f"ttft-{label}"),
                     lambda ev, got=got, t0=t0: got.append(time.perf_counter() - t0))
            while core.has_work() and not got:
                core.step()
                if cuda and k == 0:  # the first pass's chunks, each its own device time;
                    torch.cuda.synchronize()  # the figure returned has no added sync
                marks.append(time.perf_counter() - t0)
            while core.has_work():  # (the request's end: nothing left for the next one)
                core.step()
            steps = [b - a for a, b in zip([0.0] + marks, marks)]
            s = got[0]
            out.append(s)
            print(f"TTFT {tokens} tokens through the engine ({label}): {s:.3f} s "
                  f"({tokens / s:.0f} tok/s, chunks of {chunk}); steps "
                  + " ".join(f"{x:.2f}" for x in steps) + " s", flush=True)
    finally:
        core.close()
    return out[-1]


def _table(results, sizes, rows, b_p: float, pool: int) -> None:
    floor_all = pool / b_p
    print(f"\nlink floor pool_bytes / B_P = {pool / 1e9:.2f} GB / {b_p / 1e9:.1f} GB/s = "
          f"{floor_all:.3f} s per chunk")
    print(f"{'tokens':>7} {'row':16} {'s/chunk':>8} {'tok/s':>8} {'GB moved':>9} "
          f"{'floor s':>8} {'x floor':>8} {'x pool/B_P':>10}")
    for T in sizes:
        for row in rows:
            if (T, row) not in results:
                continue
            s, moved = results[(T, row)]
            floor = moved / b_p if moved else None
            xf = f"{s / floor:8.2f}" if floor else f"{'-':>8}"
            fl = f"{floor:8.3f}" if floor else f"{'-':>8}"
            print(f"{T:7d} {row:16} {s:8.3f} {T / s:8.0f} {moved / 1e9:9.2f} {fl} {xf} "
                  f"{s / floor_all:10.2f}")
        on, off = results.get((T, "stream")), results.get((T, "stream/serial"))
        if on and off:
            print(f"{T:7d} overlap gain: serial is {100 * (off[0] / on[0] - 1):.0f}% slower")
