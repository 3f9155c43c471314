"""FTW ("FreeToken weights"): a checkpoint already in the runtime layout, read at disk speed.

Layout of a directory (docs/models.md):
  ftw.index.json            the index; its presence is what makes a directory FTW
  weights-00001.ftw ...     shards of at most `--shard-gb` (a larger tensor gets a shard alone)
  config.json, tokenizer*   copied from the source checkpoint unchanged

Every shard opens with one 4 KiB header page (`MAGIC`, version, shard number); each tensor
starts at a 4 KiB-aligned offset and is zero-padded to a 4 KiB multiple, so each is read with
O_DIRECT in large aligned requests straight into a `HostArena`. Tensors are stored under their
runtime names in their runtime layout: routed experts as one bank per MoE layer
(`model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H], `...down_proj` [E, H, I]), qwen3_next
linear attention already split. Loading therefore converts nothing and discovers nothing: the
index names every tensor with its shard, offset, byte count, dtype, shape and CRC-32.

Index (JSON): {"format": "ftw", "version": 1, "alignment": 4096, "model_type", "dtype",
"total_bytes", "shards": [{"file", "bytes"}], "tensors": {name: {"shard", "offset", "nbytes",
"dtype", "shape", "crc32"}}} (`shard` indexes `shards`; `crc32` lists the CRC-32 of each
`crc_chunk_bytes` piece of the tensor, so they are computed in parallel). CRCs are checked by
`ft convert --verify DIR` (`verify_ftw`), not on every load: a load runs at disk speed.
"""
from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from tqdm import tqdm

from freetoken.checkpoint.direct_io import Read, TruncatedError, parallel_read
from freetoken.checkpoint.host_buffer import ALIGN, HostArena, TensorSpec, align_up
from freetoken.checkpoint.layout import expected_runtime
from freetoken.checkpoint.safetensors_reader import CheckpointError
from freetoken.log import get_logger, kv
from freetoken.types.model_config import ModelConfig

log = get_logger("checkpoint")

INDEX = "ftw.index.json"
MAGIC = b"FTWSHARD"
VERSION = 1
HEADER = struct.Struct("<8sII")  # magic, version, shard number (from 1); padded to ALIGN
CRC_CHUNK = 64 << 20  # one CRC-32 per 64 MiB piece of a tensor (computed in parallel)


class FtwError(CheckpointError):
    """An FTW directory that is incomplete, corrupted or for another model."""


class Entry(NamedTuple):
    name: str
    shard: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32: list[int] | None  # per CRC_CHUNK piece


def is_ftw(model_dir: str | Path) -> bool:
    return (Path(model_dir) / INDEX).is_file()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, where: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise FtwError(f"{where}: unknown dtype {name!r}")
    return dt


def read_index(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, Entry]]:
    """The index and its entries, checked against the shard files (existence, size, header)."""
    d = Path(model_dir)
    path = d / INDEX
    try:
        index = json.loads(path.read_text())
        if index.get("format") != "ftw":
            raise ValueError("not an FTW index (format != 'ftw')")
        if int(index.get("version", 0)) > VERSION:
            raise ValueError(f"version {index['version']} is newer than this reader ({VERSION})")
        shards = [(d / s["file"], int(s["bytes"])) for s in index["shards"]]
        raw = index["tensors"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FtwError(f"{path}: unreadable FTW index ({e})") from None
    for i, (f, size) in enumerate(shards, 1):
        _check_shard(f, size, i, path)
    entries: dict[str, Entry] = {}
    for name, t in raw.items():
        try:
            f, size = shards[int(t["shard"])]
            e = Entry(name, f, int(t["offset"]), int(t["nbytes"]),
                      _dtype(t["dtype"], f"{path} tensor {name}"),
                      tuple(int(x) for x in t["shape"]), t.get("crc32"))
        except (KeyError, ValueError, TypeError, IndexError) as err:
            raise FtwError(f"{path}: bad entry for tensor {name} ({err!r})") from None
        numel = 1
        for x in e.shape:
            numel *= x
        if (e.offset % ALIGN or e.offset < ALIGN or e.offset + align_up(e.nbytes) > size
                or e.nbytes != numel * torch.empty((), dtype=e.dtype).element_size()):
            raise FtwError(f"{path}: tensor {name} at offset {e.offset} ({e.nbytes} bytes, "
                           f"shape {list(e.shape)}) does not fit shard {f.name} ({size} bytes)")
        entries[name] = e
    return index, entries


def _check_shard(f: Path, size: int, number: int, index: Path) -> None:
    if not f.is_file():
        raise FtwError(f"{index} names shard {f.name}, which does not exist")
    actual = f.stat().st_size
    if actual != size:
        raise FtwError(f"shard {f} is {actual} bytes, the index says {size}: truncated or "
                       f"still being written; convert again (`ft convert SRC {f.parent}`)")
    with open(f, "rb") as h:
        magic, _version, n = HEADER.unpack(h.read(HEADER.size))
    if magic != MAGIC or n != number:
        raise FtwError(f"shard {f}: not FTW shard {number} of this index (header {magic!r}, "
                       f"shard {n})")


def _validate(cfg: ModelConfig, entries: dict[str, Entry], d: Path) -> None:
    expected = expected_runtime(cfg)
    missing = [n for n in expected if n not in entries]
    extra = [n for n in entries if n not in expected]
    if missing or extra:
        raise FtwError(f"{d / INDEX} does not match config.json ({cfg.model_type}): "
                       f"{len(missing)} tensors missing (first: {missing[:2]}), {len(extra)} "
                       f"unexpected (first: {extra[:2]}); was it converted from another model?")
    for n, shape in expected.items():
        if entries[n].shape != shape:
            raise FtwError(f"{d / INDEX}: tensor {n} has shape {list(entries[n].shape)}, the "
                           f"config expects {list(shape)}")


def load_ftw(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, progress: bool = True,
             pin: bool = False, threads: int | None = None, direct: bool = True,
             stats: dict[str, Any] | None = None) -> dict[str, Tensor]:
    """Read every tensor into two host arenas (routed experts, the rest) with parallel direct
    I/O, then pin them in place when `pin`. A dtype other than the stored one is a cast after
    the read (CPU tests run fp32 over bf16 files), and then nothing is pinned. `stats` (for
    `ft bench load`) receives bytes, read_s, post_s (pin or cast), direct, pinned."""
    d = Path(model_dir)
    _, entries = read_index(d)
    _validate(cfg, entries, d)
    groups: dict[str, list[Entry]] = {"experts": [], "rest": []}
    for e in entries.values():
        groups["experts" if ".mlp.experts." in e.name else "rest"].append(e)
    arenas = {k: HostArena([TensorSpec(e.name, e.shape, e.dtype) for e in v], k)
              for k, v in groups.items()}
    reads = [Read(e.shard, e.offset, arenas[k].region(e.name))
             for k, v in groups.items() for e in v]
    total = sum(r.dest.numel() for r in reads)
    with tqdm(total=total, desc="reading FTW", unit="B", unit_scale=True, disable=not progress,
              leave=False) as bar:
        try:
            st = parallel_read(reads, direct=direct, threads=threads, bar=bar)
        except TruncatedError as e:
            raise FtwError(str(e)) from None
    out: dict[str, Tensor] = {}
    for a in arenas.values():
        out.update(a.tensors)
    cast = any(t.dtype != dtype and t.is_floating_point() for t in out.values())
    t0 = time.perf_counter()
    if cast:  # integer tensors (deepseek_v4's tid2eid) stay as stored
        out = {n: t.to(dtype) if t.is_floating_point() else t for n, t in out.items()}
    elif pin:
        for a in arenas.values():
            a.pin()
    pinned = all(a.pinned for a in arenas.values() if a.nbytes)
    if stats is not None:
        stats.update(bytes=st.nbytes, read_s=st.seconds, post_s=time.perf_counter() - t0,
                     direct=st.direct, pinned=pinned and not cast)
    log.info(kv("ftw_loaded", dir=d, tensors=len(out), gb=f"{st.nbytes / 1e9:.2f}",
                read_s=f"{st.seconds:.2f}", gbps=f"{st.gbps:.2f}", direct=st.direct,
                threads=st.threads, pinned=pinned,
                cast=cast, post_s=f"{time.perf_counter() - t0:.2f}"))
    return out


def verify_ftw(model_dir: str | Path, progress: bool = True) -> int:
    """Read every tensor and check its CRC-32s; returns the count checked, raises `FtwError`
    naming the first tensor whose bytes differ from what was written."""
    index, entries = read_index(model_dir)
    chunk = int(index.get("crc_chunk_bytes", CRC_CHUNK))
    checked = 0
    for e in tqdm(entries.values(), desc="verifying", unit="t", disable=not progress):
        if e.crc32 is None:
            continue
        with open(e.shard, "rb") as f:
            f.seek(e.offset)
            for i, want in enumerate(e.crc32):
                data = f.read(min(chunk, e.nbytes - i * chunk))
                if zlib.crc32(data) != int(want):
                    raise FtwError(f"{e.shard}: tensor {e.name} is corrupted (CRC-32 mismatch in "
                                   f"bytes {i * chunk}..{i * chunk + len(data)}); convert the "
                                   f"checkpoint again")
        checked += 1
    return checked
