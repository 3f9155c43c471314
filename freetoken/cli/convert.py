"""`ft convert SRC DST`: a safetensors checkpoint → FTW (ftw.py); `ft convert --verify DIR`
checks an FTW directory's CRCs."""
from __future__ import annotations

import argparse
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("convert", help="convert a safetensors checkpoint to FTW (fast "
                                              "loading: runtime layout, aligned, direct I/O)")
    p.add_argument("src", help="safetensors checkpoint directory (or, with --verify alone, an "
                               "FTW directory to check)")
    p.add_argument("dst", nargs="?", default=None, help="new FTW directory")
    p.add_argument("--shard-gb", type=float, default=4.0,
                   help="largest shard (a tensor larger than this gets a shard of its own)")
    p.add_argument("--dtype", default=None,
                   help="stored dtype (default: the checkpoint's config dtype)")
    p.add_argument("--verify", action="store_true",
                   help="read the FTW result back and check every tensor's CRC-32")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from freetoken.checkpoint.ftw import verify_ftw
    from freetoken.checkpoint.ftw_write import convert
    from freetoken.checkpoint.safetensors_reader import CheckpointError
    from freetoken.cli.options import resolve_dtype

    progress = not args.no_progress
    target = args.dst or args.src
    try:
        if args.dst:
            t0 = time.perf_counter()
            dtype = resolve_dtype(args.dtype)
            index = convert(args.src, args.dst, int(args.shard_gb * 2**30), dtype, progress)
            print(f"wrote {index} in {time.perf_counter() - t0:.1f} s")
        elif not args.verify:
            print("ft convert: give DST (or --verify to check an FTW directory)")
            return 2
        if args.verify:
            n = verify_ftw(target, progress)
            print(f"{target}: {n} tensors verified")
    except CheckpointError as e:
        print(f"ft convert: {e}")
        return 1
    return 0
