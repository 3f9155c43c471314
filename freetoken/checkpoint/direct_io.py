"""Parallel reads of file byte ranges straight into their destination buffers.

Each `Read` is cut into chunks of `CHUNK` bytes spread over a thread pool (`os.preadv` drops the
GIL, so threads keep several large requests in flight: what an NVMe needs to reach its
sequential bandwidth). `direct=True` opens files with O_DIRECT, bypassing the page cache (no
copy through it, no eviction of everything else): offsets, lengths and buffers must then be
4 KiB-aligned, which FTW guarantees. Filesystems that refuse O_DIRECT (tmpfs, some network and
overlay filesystems) fall back to buffered reads with one log line.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor

from freetoken.log import get_logger, kv

log = get_logger("checkpoint")

CHUNK = 16 << 20


class TruncatedError(OSError):
    """A file ended before a byte range the index or header promised."""


class Read(NamedTuple):
    path: Path
    offset: int  # in the file
    dest: Tensor  # uint8 [n]: where the bytes go (a view of a HostArena region)


def default_threads() -> int:
    return max(4, min(16, os.cpu_count() or 4))


class _Files:
    """One descriptor per file, O_DIRECT when allowed; a buffered one after EINVAL."""

    def __init__(self, direct: bool) -> None:
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.fds: dict[tuple[Path, bool], int] = {}
        self.lock = threading.RLock()  # `_open` may log a fallback under it
        self.fell_back: set[Path] = set()

    def fd(self, path: Path, direct: bool) -> int:
        key = (path, direct)
        with self.lock:
            if key not in self.fds:
                self.fds[key] = self._open(path, direct)
            return self.fds[key]

    def _open(self, path: Path, direct: bool) -> int:
        if direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.fallback(path, "open")
        fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def fallback(self, path: Path, where: str) -> None:
        with self.lock:
            if path not in self.fell_back:
                self.fell_back.add(path)
                log.info(kv("direct_io_unavailable", file=path.name, at=where,
                            using="buffered reads"))

    def uses_direct(self, path: Path) -> bool:
        return self.direct and path not in self.fell_back

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _read_chunk(files: _Files, path: Path, offset: int, dest: Tensor) -> int:
    view = memoryview(dest.numpy())
    done = 0
    while done < len(view):
        direct = files.uses_direct(path)
        fd = files.fd(path, direct)
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:  # the filesystem takes O_DIRECT opens only
                files.fallback(path, "read")
                continue
            raise
        if n == 0:
            raise TruncatedError(f"{path}: file ends at byte {offset + done}, expected "
                                 f"{len(view) - done} more bytes there (truncated?)")
        done += n
    return done


class ReadStats(NamedTuple):
    nbytes: int
    seconds: float
    direct: bool
    threads: int

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


def parallel_read(reads: list[Read], direct: bool = True, threads: int | None = None,
                  bar: Any = None) -> ReadStats:
    """Fill every `Read.dest` from its file range; `bar` (tqdm) advances in bytes."""
    threads = threads or default_threads()
    chunks = []
    for r in reads:
        n = r.dest.numel()
        for s in range(0, n, CHUNK):
            chunks.append((r.path, r.offset + s, r.dest[s:min(n, s + CHUNK)]))
    files = _Files(direct)
    total = sum(c[2].numel() for c in chunks)
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ft-read")
    try:
        futures = [pool.submit(_read_chunk, files, *c) for c in chunks]
        for f in futures:
            n = f.result()
            if bar is not None:
                bar.update(n)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a failed read stops the rest
        files.close()
    dt = time.perf_counter() - t0
    used_direct = files.direct and not files.fell_back
    return ReadStats(total, dt, used_direct, threads)
