"""`ft bench load MODEL [MODEL ...]`: how fast weights reach the host pool and the server gets
ready, beside the disk's own sequential bandwidth measured in the same run (load_bench.py).

1. the disk: parallel O_DIRECT reads of the models' weight files (or buffered after eviction);
2. per model (safetensors or FTW) and page-cache state (cold: the files evicted first; warm:
   just read): the loader's own read into the final host layout, then the in-place pin (CUDA),
   GB/s and × disk beside the floor (file bytes / disk bandwidth);
3. per model and kernel-cache state: `ft serve` started as a subprocess, start → ready split
   into load / bandwidth profile / warm-up / other, and ready → first token. Cold kernel caches
   are a fresh cache root for Triton, flashinfer, torch extensions and FreeToken's own CPU
   kernels and bandwidth profiles (what a first start on a new machine meets); warm reuses
   that root right after (a restart).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("load", help="weight load and server start-up times beside the "
                                           "disk's measured bandwidth (safetensors vs FTW)")
    p.add_argument("models", nargs="+", help="checkpoint directories (safetensors or FTW)")
    p.add_argument("--threads", type=int, default=None, help="reader threads")
    p.add_argument("--disk-gb", type=float, default=16.0,
                   help="bytes of the weight files read to measure the disk")
    p.add_argument("--drop-caches", action="store_true",
                   help="as root, evict with `echo 3 > /proc/sys/vm/drop_caches` (default: "
                        "posix_fadvise DONTNEED on the weight files)")
    p.add_argument("--page-cache", default="cold,warm", help="cold,warm or one of them")
    p.add_argument("--no-serve", dest="serve", action="store_false",
                   help="time the weight loads only, not `ft serve` start-up")
    p.add_argument("--kernel-caches", default=None,
                   help="cold,warm (default on a GPU) or warm (default on a CPU: the user's "
                        "own caches)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra `ft serve` argument (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--out", default="load_bench", help="directory for logs and load.json")
    p.set_defaults(func=run)


def cache_env(root: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(root), "TRITON_CACHE_DIR": str(root / "triton"),
            "FLASHINFER_WORKSPACE_BASE": str(root / "flashinfer"),
            "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def _serve_rows(args: argparse.Namespace, models: list[Path], out: Path, kinds: list[str],
                drop: bool) -> list[dict[str, Any]]:
    from freetoken.bench.load_bench import evict, weight_files
    from freetoken.bench.serve_process import ServerProcess

    rows = []
    for m in models:
        root = Path(tempfile.mkdtemp(prefix="ft-kcache-", dir=out)) if "cold" in kinds else None
        for kind in kinds:
            evict(weight_files(m), drop)
            env = cache_env(root) if root is not None else None
            srv = ServerProcess(str(m), list(args.serve_arg), out / f"serve-{m.name}-{kind}.log",
                                env=env)
            with srv:
                srv.wait_ready(args.ready_timeout)
                ph = srv.phases()
                ph["first_token"] = srv.first_token_s()
            rows.append({"model": m.name, "kernel_caches": kind, **ph})
            print(f"[bench load] serve {m.name} ({kind} kernel caches): " +
                  ", ".join(f"{k} {v:.1f} s" for k, v in ph.items()), flush=True)
    return rows


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def run(args: argparse.Namespace) -> int:
    import torch

    from freetoken.bench.load_bench import disk_bandwidth, evict, timed_load, weight_files

    models = [Path(m) for m in args.models]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [f for m in models for f in weight_files(m)]
    if not files:
        raise SystemExit("ft bench load: no .safetensors or .ftw files in the given models")
    disk = disk_bandwidth(files, int(args.disk_gb * 1e9), args.threads, args.drop_caches)
    print(f"disk: {disk.gbps:.2f} GB/s sequential ({disk.method}, {disk.threads} threads x "
          f"16 MiB, {disk.nbytes / 1e9:.1f} GB of the weight files)", flush=True)
    cuda = torch.cuda.is_available()
    loads = []
    for m in models:
        for pc in [s.strip() for s in args.page_cache.split(",") if s.strip()]:
            how = evict(weight_files(m), args.drop_caches) if pc == "cold" else "just read"
            # in a child process: this one never holds a CUDA context (VRAM the server
            # started below would otherwise not get) nor the pool's memory afterwards
            with mp.get_context("spawn").Pool(1) as pool:
                st = pool.apply(timed_load, (m, cuda, args.threads))
            st.update(model=m.name, page_cache=pc, evicted_by=how)
            loads.append(st)
            print(f"[bench load] {m.name} {st['format']} {pc}: {st['total_s']:.2f} s", flush=True)
    serves: list[dict[str, Any]] = []
    if args.serve:
        kinds = (args.kernel_caches or ("cold,warm" if cuda else "warm")).split(",")
        serves = _serve_rows(args, models, out, [k.strip() for k in kinds if k.strip()],
                             args.drop_caches)
    lines = [(f"disk sequential read: {disk.gbps:.2f} GB/s ({disk.method}, {disk.threads} "
             f"threads, {disk.nbytes / 1e9:.1f} GB)"), "",
             "| model | format | page cache | GB | read s | GB/s | floor s | x disk | pin s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for st in loads:
        gb = st["file_bytes"] / 1e9
        floor = gb / disk.gbps
        lines.append(f"| {st['model']} | {st['format']}{' (O_DIRECT)' if st.get('direct') else ''}"
                     f" | {st['page_cache']} | {gb:.2f} | {st['read_s']:.2f} | "
                     f"{gb / st['read_s']:.2f} | {floor:.2f} | {floor / st['read_s']:.2f} | "
                     f"{_f(st['post_s'], 2) if st.get('pinned') else '-'} |")
    if serves:
        lines += ["", ("| model | kernel caches | load s | profile s | warm-up s | other s | "
                      "start->ready s | load floor s | ready->first token s |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        sizes = {m.name: sum(f.stat().st_size for f in weight_files(m)) for m in models}
        for r in serves:
            lines.append(f"| {r['model']} | {r['kernel_caches']} | {_f(r.get('load'))} | "
                         f"{_f(r.get('profile'))} | {_f(r.get('warm_up'))} | "
                         f"{_f(r.get('other'))} | {_f(r.get('ready'))} | "
                         f"{sizes[r['model']] / 1e9 / disk.gbps:.1f} | "
                         f"{_f(r.get('first_token'), 2)} |")
    text = "\n".join(lines)
    print(text)
    (out / "load.md").write_text(text + "\n")
    (out / "load.json").write_text(json.dumps({"disk": disk._asdict(), "loads": loads,
                                               "serves": serves}, indent=1, default=str))
    return 0
