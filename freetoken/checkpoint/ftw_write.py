"""Write FTW (layout in ftw.py): `FtwWriter` streams tensors into bounded shards; `convert`
turns a safetensors checkpoint into FTW (`ft convert SRC DST`).

The index is written last, through a temporary file and a rename: a conversion that dies half
way leaves no index, so the directory is never mistaken for a complete FTW checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor
from tqdm import tqdm

from freetoken.checkpoint.ftw import (
    CRC_CHUNK,
    HEADER,
    INDEX,
    MAGIC,
    VERSION,
    dtype_name,
    is_ftw,
)
from freetoken.checkpoint.host_buffer import ALIGN, align_up
from freetoken.log import get_logger, kv

log = get_logger("checkpoint")

DEFAULT_SHARD_BYTES = 4 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".ftw", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", INDEX)


def tensor_bytes(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype (bf16 has no numpy type)."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class FtwWriter:
    """`add(name, tensor)` appends one tensor at the next 4 KiB boundary of the current shard,
    opening a new shard when it would grow past `shard_bytes`; `close(meta)` writes the index."""

    def __init__(self, dst: str | Path, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.dst = Path(dst)
        self.dst.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self.shards: list[dict[str, Any]] = []
        self.tensors: dict[str, dict[str, Any]] = {}
        self._f: BinaryIO | None = None
        self._pos = 0
        self.total = 0
        # zlib.crc32 runs at ~1 GB/s and drops the GIL: CRCs of CRC_CHUNK pieces in parallel
        # keep conversion at disk speed
        self._crc = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))

    def _open_shard(self) -> None:
        self._close_shard()
        name = f"weights-{len(self.shards) + 1:05d}.ftw"
        self._f = open(self.dst / name, "wb")  # noqa: SIM115 (closed in _close_shard)
        header = HEADER.pack(MAGIC, VERSION, len(self.shards) + 1)
        self._f.write(header + bytes(ALIGN - len(header)))
        self._pos = ALIGN
        self.shards.append({"file": name, "bytes": 0})

    def _close_shard(self) -> None:
        if self._f is None:
            return
        self._f.close()
        self.shards[-1]["bytes"] = self._pos
        self._f = None

    def add(self, name: str, t: Tensor) -> None:
        if name in self.tensors:
            raise ValueError(f"tensor {name} written twice")
        data = tensor_bytes(t)
        n = len(data)
        padded = align_up(n)
        if self._f is None or (self._pos > ALIGN and self._pos + padded > self.shard_bytes):
            self._open_shard()
        assert self._f is not None
        self._f.write(data)
        self._f.write(bytes(padded - n))
        self.tensors[name] = {"shard": len(self.shards) - 1, "offset": self._pos, "nbytes": n,
                              "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                              "crc32": self.crcs(data)}
        self._pos += padded
        self.total += n

    def crcs(self, data: memoryview) -> list[int]:
        return list(self._crc.map(zlib.crc32, [data[i:i + CRC_CHUNK]
                                               for i in range(0, len(data), CRC_CHUNK)]))

    def close(self, meta: dict[str, Any]) -> Path:
        self._close_shard()
        self._crc.shutdown()
        index = {"format": "ftw", "version": VERSION, "alignment": ALIGN, **meta,
                 "crc_chunk_bytes": CRC_CHUNK,
                 "total_bytes": self.total, "shards": self.shards, "tensors": self.tensors}
        tmp = self.dst / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self.dst / INDEX)
        return self.dst / INDEX


def ftw_order(names: list[str]) -> list[str]:
    """Routed-expert banks first (layer order), then everything else in the given order."""
    experts = [n for n in names if ".mlp.experts." in n]
    return experts + [n for n in names if ".mlp.experts." not in n]


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy config, tokenizer, chat template, generation config (every top-level file that is
    not weights) from `src` to `dst`."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def write_ftw(tensors: dict[str, Tensor], dst: str | Path, meta: dict[str, Any],
              shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True) -> Path:
    w = FtwWriter(dst, shard_bytes)
    names = ftw_order(list(tensors))
    total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    with tqdm(total=total, desc="writing FTW", unit="B", unit_scale=True,
              disable=not progress) as bar:
        for n in names:
            w.add(n, tensors[n])
            bar.update(tensors[n].numel() * tensors[n].element_size())
    return w.close(meta)


def convert(src: str | Path, dst: str | Path, shard_bytes: int = DEFAULT_SHARD_BYTES,
            dtype: torch.dtype | None = None, progress: bool = True) -> Path:
    """safetensors checkpoint `src` → FTW `dst` (a new or empty directory)."""
    from freetoken.checkpoint.safetensors_reader import CheckpointError, load_checkpoint
    from freetoken.types.model_config import load_config

    src, dst = Path(src), Path(dst)
    if is_ftw(src):
        raise CheckpointError(f"{src} is already FTW")
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty")
    cfg = load_config(src)
    if not isinstance(cfg.expert_format, torch.dtype):  # FTW holds dense banks only
        raise CheckpointError(f"{src} stores its experts quantized ({cfg.expert_format.name}); "
                              "FTW holds dense banks only: serve the safetensors checkpoint")
    dtype = dtype or cfg.torch_dtype
    tensors = load_checkpoint(src, cfg, dtype=dtype, progress=progress)
    dst.mkdir(parents=True, exist_ok=True)
    copied = copy_side_files(src, dst)
    index = write_ftw(tensors, dst, {"model_type": cfg.model_type, "dtype": dtype_name(dtype),
                                     "source": src.name}, shard_bytes, progress)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    log.info(kv("converted", src=src, dst=dst, tensors=len(tensors), gb=f"{size / 1e9:.2f}",
                copied=len(copied)))
    return index
