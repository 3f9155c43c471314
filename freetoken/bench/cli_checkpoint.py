"""`ft bench checkpoint --shape NAME [--layers N] OUT`: write a random-weight checkpoint in the
shape's released layout (checkpoint_writer.py) that `ft serve --model OUT` loads like a
downloaded one."""
from __future__ import annotations

import argparse
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    from freetoken.types.presets import SHAPES

    p = subparsers.add_parser("checkpoint", help="write a random-weight checkpoint in a real "
                                                 "model's released layout")
    p.add_argument("out", help="output directory (new or empty)")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="cut the model to N layers")
    p.add_argument("--format", choices=("safetensors", "ftw", "random"), default="safetensors",
                   dest="fmt", help="safetensors as released, FTW (the runtime layout), or random "
                   "(no weight files: `ft serve` makes FTW's tensors in memory at load)")
    p.add_argument("--shard-gb", type=float, default=4.0, help="largest shard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from freetoken.bench.checkpoint_writer import write_checkpoint

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"ft bench checkpoint: {out} exists and is not empty")
        return 2
    t0 = time.perf_counter()
    write_checkpoint(args.shape, args.layers, out, args.fmt, int(args.shard_gb * 2**30),
                     args.seed, progress=not args.no_progress)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    dt = time.perf_counter() - t0
    print(f"wrote {out} ({args.fmt}, {size / 1e9:.2f} GB) in {dt:.1f} s "
          f"({size / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    return 0
