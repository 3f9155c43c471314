"""safetensors read in place: every tensor whose stored dtype is the runtime dtype and that
needs no layout change is read (parallel `pread`s) straight into its final host buffer.

A per-expert HF layout still lands in the runtime banks without a copy: expert e's gate_proj
[I, H] is bank rows [e, 0:I], its up_proj rows [e, I:2I] (contiguous bytes of gate_up [E, 2I, H])
and its down_proj [H, I] is down[e]. safetensors offsets are not 4 KiB-aligned, so these reads go
through the page cache (O_DIRECT needs aligned file offsets): FTW is the aligned form.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from freetoken.checkpoint.direct_io import Read, parallel_read
from freetoken.checkpoint.host_buffer import HostArena, TensorSpec
from freetoken.checkpoint.layout import expert_bank_names, runtime_name
from freetoken.types.model_config import ModelConfig

ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
             "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
             "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def data_ranges(file: Path) -> dict[str, tuple[torch.dtype | None, int, int]]:
    """name → (dtype, absolute begin, end) from a safetensors header."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    base = 8 + n
    return {k: (ST_DTYPES.get(v["dtype"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


class InPlace:
    """The tensors of one checkpoint that can be read in place, and the arenas they go to."""

    def __init__(self, cfg: ModelConfig, files: dict[str, Path], shapes: dict[str, tuple],
                 dtype: torch.dtype, aliases: dict[str, str] | None = None) -> None:
        """`files`: name → file of the tensors to consider; `aliases`: {name in the file:
        that name} for tensors stored under another spelling (scan_headers' `key`)."""
        ranges: dict[str, tuple[Path, int, int]] = {}
        ok: set[str] = set()
        aliases = aliases or {}
        for f in set(files.values()):
            for key, (dt, b, e) in data_ranges(f).items():
                name = aliases.get(key, key)
                if name in files:
                    ranges[name] = (f, b, e)
                    if dt == dtype:
                        ok.add(name)
        self.consumed: set[str] = set()  # disk names read in place
        experts: list[TensorSpec] = []
        rest: list[TensorSpec] = []
        pieces: list[tuple[str, str, int]] = []  # (disk name, runtime bank, byte offset in it)
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        es = torch.empty((), dtype=dtype).element_size()
        for layer in cfg.moe_layers:
            disk_gu, disk_dn = expert_bank_names(cfg, layer)
            gu, dn = expert_bank_names(cfg, layer, prefix="model.")
            if disk_gu in files:
                layer_pieces = [(disk_gu, gu, 0), (disk_dn, dn, 0)]
            else:
                p = f"{cfg.weight_prefix}layers.{layer}.{cfg.moe_module}.experts."
                g, u, d = cfg.expert_names  # gate_proj / up_proj / down_proj (kimi: w1 / w3 / w2)
                layer_pieces = []
                for e in range(E):
                    layer_pieces += [(f"{p}{e}.{g}.weight", gu, e * 2 * I * H * es),
                                     (f"{p}{e}.{u}.weight", gu, (e * 2 + 1) * I * H * es),
                                     (f"{p}{e}.{d}.weight", dn, e * H * I * es)]
            if all(d in ok for d, _, _ in layer_pieces):
                experts += [TensorSpec(gu, (E, 2 * I, H), dtype), TensorSpec(dn, (E, H, I), dtype)]
                pieces += layer_pieces
        fused_la = cfg.linear_fused_qkvz
        per_expert = f".{cfg.moe_module}.experts."  # banks only, assembled above
        for name, shape in shapes.items():
            if per_expert in name or name not in ok:
                continue
            if fused_la and (name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight"))):
                continue  # regrouped by split_fused: not a plain copy
            rt = runtime_name(cfg, name)
            rest.append(TensorSpec(rt, tuple(shape), dtype))
            pieces.append((name, rt, 0))
        self.arenas = [HostArena(experts, "experts"), HostArena(rest, "rest")]
        self.reads = []
        for disk, rt, off in pieces:
            f, b, e = ranges[disk]
            arena = self.arenas[0] if rt in self.arenas[0].offsets else self.arenas[1]
            o = arena.offsets[rt] + off
            self.reads.append(Read(f, b, arena.bytes_at(o, e - b)))
            self.consumed.add(disk)

    def read(self, threads: int | None = None, bar: Any = None) -> dict[str, Tensor]:
        parallel_read(self.reads, direct=False, threads=threads, bar=bar)
        out: dict[str, Tensor] = {}
        for a in self.arenas:
            out.update(a.tensors)
        return out

    def pin(self) -> None:
        for a in self.arenas:
            a.pin()
