"""`ft bench bw`: measure B_P and B_H (and both at once), print q*, save the machine profile.

Each rate is printed beside its ceiling (host read stream for B_H, one large pinned copy for
B_P). Without CUDA, B_P is skipped with a message and the profile holds B_H alone.

`--format` picks the bank format measured (default: the shape preset's own, e.g. MXFP4 for
gpt-oss-120b; `dense` takes `--dtype`): a quantized pool is read by the quantized CPU kernel
and copied as codes + scales, every rate counts the real bytes (`expert_nbytes`), and the
profile is saved under that format, the key a quantized store's runtime looks up.
"""
from __future__ import annotations

import argparse

import torch

from freetoken.experts import calibrate as bw
from freetoken.experts import profile as bwp
from freetoken.experts.cost_model import (
    BandwidthProfile,
    q_star,
    q_star_overlapped,
    recommend_backend,
)
from freetoken.types.model_config import ExpertFormat

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bw", help="host/link bandwidths, q*, backend recommendation")
    p.add_argument("--shape", choices=sorted(bwp.SHAPES), default="qwen3.6-35b-a3b")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16",
                   help="the dense format's dtype")
    p.add_argument("--format", choices=["preset", "dense", "fp8", "mxfp4"], default="preset",
                   help="expert bank format (default: the shape preset's own)")
    p.add_argument("--block", type=int, default=128, help="fp8 scale block edge")
    p.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    p.add_argument("--pool-gb", type=float, default=4.0,
                   help="host pool per measurement; must be far larger than the LLC")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU kernel threads (default: what the CPU branch of `ft serve` uses: "
                        "torch's thread count, less one core when a GPU is present)")
    p.add_argument("--no-save", action="store_true")
    p.set_defaults(func=run)


def _pct(v: float | None, ceil: float | None) -> str:
    return f"{100 * v / ceil:5.1f}%" if v and ceil else "    -"


def bank_format(args: argparse.Namespace) -> torch.dtype | ExpertFormat:
    """The format `--format` / `--dtype` / `--block` name for `--shape`."""
    if args.format == "preset":
        fmt = bwp.preset_format(args.shape)
        return fmt if isinstance(fmt, ExpertFormat) else _DTYPES[args.dtype]
    if args.format == "dense":
        return _DTYPES[args.dtype]
    return ExpertFormat(args.format, args.block if args.format == "fp8" else 32)


def run(args: argparse.Namespace) -> int:
    shape, dtype = bwp.SHAPES[args.shape], bank_format(args)
    if args.threads is None:
        from freetoken.experts.runtime import default_cpu_threads

        args.threads = default_cpu_threads("cuda" if torch.cuda.is_available() else "cpu")
    prof = bw.measure_profile(args.shape, shape, dtype, args.seconds, args.pool_gb, args.threads,
                           say=lambda line: print(line, flush=True))
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
