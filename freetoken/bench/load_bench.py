"""Pieces of `ft bench load`: the disk's own sequential read bandwidth, page-cache eviction, and
one timed weight load.

The disk is measured on the model's own files, in the same run, the way the FTW loader reads:
several threads, 16 MiB aligned requests, O_DIRECT, so the page cache cannot flatter the figure
whatever its size. Where O_DIRECT is refused the files are first evicted from the page cache
(`posix_fadvise(DONTNEED)`, or `echo 3 > /proc/sys/vm/drop_caches` as root with
`--drop-caches`) and read buffered; the method is printed beside the figure.
"""
from __future__ import annotations

import errno
import gc
import os
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from freetoken.checkpoint.direct_io import CHUNK, default_threads
from freetoken.checkpoint.host_buffer import HostArena, TensorSpec


class DiskBandwidth(NamedTuple):
    gbps: float
    nbytes: int
    seconds: float
    method: str
    threads: int


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(f for f in model_dir.iterdir()
                  if f.is_file() and f.suffix in (".ftw", ".safetensors"))


def evict(files: list[Path], drop_caches: bool = False) -> str:
    """Make the next read of `files` come from the disk; returns how."""
    if drop_caches and os.geteuid() == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a checkpoint just written) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise(DONTNEED)"


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY), False


def disk_bandwidth(files: list[Path], limit_bytes: int, threads: int | None = None,
                   drop_caches: bool = False) -> DiskBandwidth:
    """Sequential read GB/s over (at most `limit_bytes` of) `files`."""
    threads = threads or default_threads()
    chunks: list[tuple[Path, int]] = []
    total = 0
    for f in files:
        size = f.stat().st_size
        for off in range(0, size, CHUNK):
            if total >= limit_bytes:
                break
            chunks.append((f, off))
            total += min(CHUNK, size - off)
    fds = {f: _open(f, True) for f in {c[0] for c in chunks}}
    direct = all(d for _, d in fds.values())
    method = "O_DIRECT"
    if not direct:
        method = f"buffered after {evict(list(fds), drop_caches)}"
    arena = HostArena([TensorSpec(f"t{i}", (CHUNK,), torch.uint8) for i in range(threads)],
                      "disk-bw")
    bufs = [memoryview(arena.tensors[f"t{i}"].numpy()) for i in range(threads)]
    lock, done, nbytes = threading.Lock(), [0], [0]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            while True:
                with lock:
                    if done[0] >= len(chunks):
                        return
                    f, off = chunks[done[0]]
                    done[0] += 1
                n = os.preadv(fds[f][0], [bufs[i]], off)
                with lock:
                    nbytes[0] += n
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
            errors.append(e)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    dt = time.perf_counter() - t0
    for fd, _ in fds.values():
        os.close(fd)
    if errors:
        raise errors[0]
    return DiskBandwidth(nbytes[0] / dt / 1e9, nbytes[0], dt, method, threads)


def timed_load(model_dir: Path, pin: bool, threads: int | None = None) -> dict[str, Any]:
    """One weight load (the loader's own `read_weights`), its figures, then free everything."""
    from freetoken.checkpoint.ftw import is_ftw
    from freetoken.checkpoint.reader import read_weights
    from freetoken.types.model_config import load_config

    cfg = load_config(model_dir)
    stats: dict[str, Any] = {}
    t0 = time.perf_counter()
    tensors = read_weights(model_dir, cfg, cfg.torch_dtype, pin=pin, progress=False,
                           threads=threads, stats=stats)
    total = time.perf_counter() - t0
    del tensors
    gc.collect()
    stats.update(total_s=total, format="ftw" if is_ftw(model_dir) else "safetensors",
                 file_bytes=sum(f.stat().st_size for f in weight_files(model_dir)))
    return stats
