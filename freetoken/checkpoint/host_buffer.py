"""Host memory that weights are read straight into, and pinned afterwards in place.

A `HostArena` is one anonymous page-aligned mapping (transparent huge pages requested, so tens
of GB fault in 2 MiB pages, not 4 KiB ones) cut into tensors at 4 KiB-aligned offsets: the
alignment O_DIRECT needs for its destination buffers. The tensors are views of the mapping
(`torch.frombuffer` keeps it alive while any view lives), so no copy is ever made to place or
pin them. `pin()` registers the filled mapping with CUDA (`cudaHostRegister`) in place: pinning
an empty buffer first (`torch.empty(pin_memory=True)`) would lock and zero every page before a
byte is read, and `Tensor.pin_memory()` afterwards copies the whole pool once more. The
registration is dropped when the mapping dies (a fused backend moves the banks to the GPU and
lets the host copy go).
"""
from __future__ import annotations

import contextlib
import math
import mmap
from typing import NamedTuple

import torch
from torch import Tensor

from freetoken.log import get_logger, kv

log = get_logger("checkpoint")

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class TensorSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _Mapping(mmap.mmap):
    """An anonymous mapping that undoes its CUDA host registration before it is unmapped
    (`__del__` runs before mmap's own deallocation)."""

    registered_ptr = 0

    def __del__(self) -> None:
        if self.registered_ptr:
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone
                torch.cuda.cudart().cudaHostUnregister(self.registered_ptr)
            self.registered_ptr = 0


class HostArena:
    """Tensors `specs` laid out at 4 KiB-aligned offsets in one mapping.

    `tensors[name]` is a view of its region; `region(name)` is the region as a writable uint8
    tensor padded to a 4 KiB multiple (reads of whole pages land there)."""

    def __init__(self, specs: list[TensorSpec], label: str = "weights") -> None:
        self.label = label
        self.offsets: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        off = 0
        for s in specs:
            self.offsets[s.name], self.sizes[s.name] = off, align_up(s.nbytes)
            off += self.sizes[s.name]
        self.nbytes = off
        self.pinned = False
        self._map: _Mapping | None = None
        self.tensors: dict[str, Tensor] = {}
        if not off:
            return
        self._map = _Mapping(-1, off)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # [nbytes]
        for s in specs:
            o = self.offsets[s.name]
            self.tensors[s.name] = self._bytes[o:o + s.nbytes].view(s.dtype).view(s.shape)

    def bytes_at(self, offset: int, n: int) -> Tensor:
        """uint8 [n] view of the mapping at `offset`."""
        return self._bytes[offset:offset + n]

    def region(self, name: str) -> Tensor:
        o = self.offsets[name]
        return self._bytes[o:o + self.sizes[name]]

    def pin(self) -> bool:
        """Register the (filled) mapping with CUDA in place. False, with a log line, when that
        fails: the expert store then pins by copying, as before."""
        if self._map is None or self.pinned:
            return self.pinned
        ptr = self._bytes.data_ptr()
        try:
            err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0)
            code = int(err.value if hasattr(err, "value") else err)
        except Exception as e:  # noqa: BLE001 (no CUDA runtime in this build)
            log.warning(kv("pin_in_place_failed", arena=self.label, error=repr(e)))
            return False
        if code != 0:
            log.warning(kv("pin_in_place_failed", arena=self.label, cuda_error=code))
            return False
        self._map.registered_ptr = ptr
        self.pinned = True
        return True
