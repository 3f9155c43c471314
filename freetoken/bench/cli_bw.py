"""`ft bench bw`: measure B_P and B_H (and both at once), print q*, save the machine profile.

Each rate is printed beside its ceiling (host read stream for B_H, one large pinned copy for
B_P). Without CUDA, B_P is skipped with a message and the profile holds B_H alone.
"""
from __future__ import annotations

import argparse
import time

import torch

from freetoken.bench import bandwidth as bw
from freetoken.experts import profile as bwp
from freetoken.experts.cost_model import (
    BandwidthProfile,
    q_star,
    q_star_overlapped,
    recommend_backend,
)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bw", help="host/link bandwidths, q*, backend recommendation")
    p.add_argument("--shape", choices=sorted(bwp.SHAPES), default="qwen3.6-35b-a3b")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    p.add_argument("--pool-gb", type=float, default=4.0,
                   help="host pool per measurement; must be far larger than the LLC")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU kernel threads (default: what the CPU branch of `ft serve` uses: "
                        "torch's thread count, less one core when a GPU is present)")
    p.add_argument("--no-save", action="store_true")
    p.set_defaults(func=run)


def _steps_for(seconds: float, step_s: float) -> int:
    return int(min(5000, max(10, seconds / max(step_s, 1e-6))))


def _pct(v: float | None, ceil: float | None) -> str:
    return f"{100 * v / ceil:5.1f}%" if v and ceil else "    -"


def run(args: argparse.Namespace) -> int:
    shape, dtype = bwp.SHAPES[args.shape], _DTYPES[args.dtype]
    if args.threads is None:
        from freetoken.experts.setup import default_cpu_threads

        args.threads = default_cpu_threads("cuda" if torch.cuda.is_available() else "cpu")
    s_bytes = shape.expert_bytes(dtype)
    pool = args.pool_gb * 1e9
    print(f"[bw] shape={args.shape} dtype={args.dtype} expert={s_bytes / 1e6:.2f} MB "
          f"pool={args.pool_gb:g} GB threads={args.threads}", flush=True)

    print("[bw] host read ceiling ...", flush=True)
    host_read = bw.host_read_gbps(min(pool, 4e9),  # the machine's: every thread
                                   threads=max(args.threads, torch.get_num_threads()))

    print("[bw] B_H: CPU kernel, batch 1, fresh experts ...", flush=True)
    cpu_pool = bw.make_pool(shape, dtype, pool)
    fn = bw.cpu_kernel_fn(args.threads)
    n_pool = cpu_pool[0].shape[0]
    # one untimed pass over the whole pool first (a fresh pool's first reads ran slower on the
    # H200 host), then the median of three windows: the host's bandwidth drifts with its
    # other tenants, and B_H steers `auto` and every floor
    warm = bw.fresh_routes(n_pool, shape.experts, 1, shape.top_k, n_pool // shape.top_k + 1, 7)
    _, step_s = bw.time_experts(fn, *cpu_pool, warm, warmup=0)
    steps = _steps_for(args.seconds, step_s)
    windows = sorted(
        bw.time_experts(fn, *cpu_pool, bw.fresh_routes(n_pool, shape.experts, 1, shape.top_k,
                                                       max(3, steps // 3), w))[0]
        for w in range(3))
    b_h = windows[1]
    print(f"[bw] B_H windows: {', '.join(f'{v:.1f}' for v in windows)} GB/s (median kept)",
          flush=True)

    b_p = link = b_p_o = b_h_o = None
    if torch.cuda.is_available():
        print("[bw] B_P: pinned pool -> GPU slots ...", flush=True)
        fill = bw.FillBench(shape, dtype, pool)
        link = fill.link_gbps()
        fill.run(3)
        b_p = fill.run(_steps_for(args.seconds, shape.top_k * s_bytes / (b_p or 30e9)))
        print("[bw] B_P' and B_H' concurrently ...", flush=True)
        b_p_o, b_h_o = bw.measure_overlap(fill, cpu_pool, steps, args.threads)
    else:
        print("[bw] no CUDA device: B_P skipped (the profile holds B_H only)", flush=True)

    prof = BandwidthProfile(
        key=bwp.profile_key(args.shape, dtype), b_h=b_h, b_p=b_p, b_p_overlap=b_p_o,
        b_h_overlap=b_h_o, host_read=host_read, link=link, expert_bytes=s_bytes,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), cpu_threads=args.threads,
    )
    _print_table(prof)
    if not args.no_save:
        print(f"[bw] saved {bwp.save_profile(prof)}")
    return 0


def _print_table(p: BandwidthProfile) -> None:
    def f(v: float | None) -> str:
        return f"{v:7.1f}" if v is not None else "      -"

    print(f"\n{'rate':<30}{'GB/s':>8}  {'of ceiling':>10}")
    print(f"{'host read ceiling':<30}{f(p.host_read)}")
    print(f"{'B_H  cpu kernel (T=1)':<30}{f(p.b_h)}  {_pct(p.b_h, p.host_read):>10}")
    print(f"{'link ceiling (1 big copy)':<30}{f(p.link)}")
    print(f"{'B_P  fill (expert copies)':<30}{f(p.b_p)}  {_pct(p.b_p, p.link):>10}")
    if p.has_overlap:
        assert p.b_p_overlap is not None and p.b_h_overlap is not None
        both = p.b_p_overlap + p.b_h_overlap
        print(f"{'B_P overlapped':<30}{f(p.b_p_overlap)}")
        print(f"{'B_H overlapped':<30}{f(p.b_h_overlap)}")
        print(f"{'host bytes, both at once':<30}{f(both)}  {_pct(both, p.host_read):>10}")
    if p.b_p is not None:
        print("\n  m  q*(linear)  q*(overlap)")
        for m in range(1, 17):
            qo = (q_star_overlapped(m, p.b_p_overlap, p.b_h_overlap)
                  if p.b_p_overlap is not None and p.b_h_overlap is not None else "-")
            print(f"{m:3d}  {q_star(m, p.b_p, p.b_h):10d}  {qo!s:>11}")
    print("\ncache hit rate  recommended backend")
    for rate in (0.0, 0.37, 0.6, 0.9):
        print(f"{rate:14.2f}  {recommend_backend(p, rate)}")
