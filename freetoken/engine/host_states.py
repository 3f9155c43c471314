"""The host tier of recurrent-state snapshots, allocated in chunks behind the engine's back.

A host slot holds one snapshot of every linear-attention layer: conv[l] `[conv_dim, K-1]` and
ssm[l] `[Hv, dk, dv]`, with the dtypes of the device `StateTensors`. A real model's tier is tens
of GB (748 slots x 31 MB on the Qwen3.6 shape), and pinning that much at start-up took 21 s of
the server's start-to-ready on the H200 (2026-12-02). So the tier is cut into chunks: a chunk is
one flat buffer holding `chunk_slots` whole slots (slot-major, every layer's tensor at an
offset aligned to 64 bytes), pinned when the device is CUDA. Chunks are allocated by a daemon
thread in slot order, paced so that it never holds the CPU for long, and only while the engine
has no request (`busy`): a `cudaHostAlloc` of a 64 MB chunk takes ~40 ms, during which the
engine thread's own CUDA calls wait on the driver, so a fill paced at half the time beside
decode took up to half of every served decode step (every served figure of 2026-12-02/03 ran
within the first 30 s of a start, inside the fill). A spill or restore that reaches a slot
whose chunk is not there yet allocates that chunk itself (once, under the lock). Either way the
engine is ready at once and the tier's capacity is the same from the first step.

The chunk size is chosen so that `chunk_slots * slot_bytes` fills a power of two closely:
torch's pinned-memory allocator rounds every allocation up to one, so one `[N, ...]` tensor per
layer (the layout before) wasted up to half of the pinned bytes.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from freetoken.cache.tensors import StateTensors
from freetoken.log import get_logger, kv

log = get_logger("engine")

_ALIGN = 64
CHUNK_TARGET = 64 << 20  # bytes per chunk, at least (one slot per chunk when a slot is larger)


FILL_TRIES, FILL_RETRY_S = 4, 0.5  # a failed background allocation: retries, first pause
_FILLING: weakref.WeakSet[HostStates] = weakref.WeakSet()  # tiers whose fill may still run


@atexit.register
def _stop_fills() -> None:
    """At interpreter exit, stop every fill still running: a daemon thread caught inside
    `cudaHostAlloc` while the process tears its C++ runtime down aborts it ("terminate called
    without an active exception", exit 134, after `ft bench prefill --ttft` and
    `ft bench elastic` on the H200, whose engines were never closed)."""
    for tier in list(_FILLING):
        tier.close()


@dataclass(frozen=True)
class _Part:
    """One layer tensor's place inside a slot: byte offset, shape, dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def chunk_slots_for(slot_bytes: int, target: int = CHUNK_TARGET, max_waste: float = 0.05) -> int:
    """Slots per chunk: the fewest that reach `target` bytes while `slots * slot_bytes` wastes
    at most `max_waste` of the power of two the pinned allocator rounds it up to."""
    if slot_bytes <= 0:
        raise ValueError("slot_bytes must be positive")
    p = 1
    while p < max(slot_bytes, target):
        p *= 2
    while True:
        slots = p // slot_bytes
        if slots >= 1 and (p - slots * slot_bytes) / p <= max_waste:
            return slots
        p *= 2


class HostStates:
    """Host-RAM copies of state slots, `num_slots` of them, in chunks (see the module text).

    `views(slot)` gives the slot's tensors in the order `like.conv + like.ssm`; `fill` (default
    on) starts the background allocation; `close()` stops it. Thread-safe: the engine thread
    and the fill thread meet only in `_chunk`, under one lock."""

    def __init__(self, like: StateTensors, num_slots: int, fill: bool = True,
                 chunk_target: int = CHUNK_TARGET, pace: float = 1.0) -> None:
        self.num_slots = num_slots
        self.pinned = bool(like.conv and like.conv[0].is_cuda)
        parts, off = [], 0
        for t in like.conv + like.ssm:
            part = _Part(off, tuple(t.shape[1:]), t.dtype)
            parts.append(part)
            off = _align(off + part.nbytes)
        self.parts, self.slot_bytes = parts, max(off, _ALIGN)
        self.n_conv = len(like.conv)
        self.chunk_slots = chunk_slots_for(self.slot_bytes, chunk_target)
        n_chunks = (num_slots + self.chunk_slots - 1) // self.chunk_slots
        self._chunks: list[torch.Tensor | None] = [None] * n_chunks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.alloc_seconds = 0.0
        self.on_demand = 0  # chunks the engine thread had to allocate itself
        self._pace = pace
        self._idle = threading.Event()  # set while the engine has no request: the fill runs
        self._idle.set()
        self.paused_s = 0.0  # seconds the fill waited for the engine to go idle
        self._thread: threading.Thread | None = None
        if fill and n_chunks:
            self._thread = threading.Thread(target=self._fill, name="ft-host-states", daemon=True)
            _FILLING.add(self)
            self._thread.start()

    @property
    def chunks_ready(self) -> int:
        return sum(c is not None for c in self._chunks)

    def _chunk(self, c: int, on_demand: bool) -> torch.Tensor:
        buf = self._chunks[c]
        if buf is not None:
            return buf
        with self._lock:
            buf = self._chunks[c]
            if buf is None:
                t0 = time.perf_counter()
                slots = min(self.chunk_slots, self.num_slots - c * self.chunk_slots)
                buf = self._alloc(slots * self.slot_bytes)
                self.alloc_seconds += time.perf_counter() - t0
                self._chunks[c] = buf
                if on_demand:
                    self.on_demand += 1
                    log.info(kv("state_host_chunk_on_demand", chunk=c, slots=slots,
                                ms=f"{(time.perf_counter() - t0) * 1e3:.1f}"))
        return buf

    def busy(self, flag: bool) -> None:
        """The engine has requests (the fill waits) or none (it goes on)."""
        if flag:
            self._idle.clear()
        else:
            self._idle.set()

    def _wait_idle(self) -> bool:
        """Wait until the engine is idle; False if the tier is closed meanwhile."""
        t0 = time.perf_counter()
        while not self._idle.wait(0.05):
            if self._stop.is_set():
                return False
        self.paused_s += time.perf_counter() - t0
        return not self._stop.is_set()

    def _alloc(self, nbytes: int) -> torch.Tensor:
        # empty: a slot is always written by a spill before a restore reads it
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def views(self, slot: int) -> list[torch.Tensor]:
        """The slot's tensors, `like.conv + like.ssm` order (views into its chunk)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"host state slot {slot} out of range [0, {self.num_slots})")
        c, i = divmod(slot, self.chunk_slots)
        buf = self._chunk(c, on_demand=True)
        base = i * self.slot_bytes
        return [buf[base + p.offset: base + p.offset + p.nbytes].view(p.dtype).view(p.shape)
                for p in self.parts]

    def _fill(self) -> None:
        t0 = time.perf_counter()
        for c in range(len(self._chunks)):
            if not self._wait_idle():
                return
            t = time.perf_counter()
            if not self._fill_chunk(c):
                return
            # paced: sleep as long as the allocation took (x pace), so the engine thread gets
            # the interpreter and the driver at least half of the time
            self._stop.wait((time.perf_counter() - t) * self._pace)
        log.info(kv("state_host_tier_filled", chunks=len(self._chunks), slots=self.num_slots,
                    mb=self.num_slots * self.slot_bytes // 2**20,
                    seconds=f"{time.perf_counter() - t0:.1f}",
                    alloc_seconds=f"{self.alloc_seconds:.1f}", on_demand=self.on_demand,
                    paused_s=f"{self.paused_s:.1f}"))

    def _fill_chunk(self, c: int, tries: int = FILL_TRIES) -> bool:
        """Allocate chunk c for the background fill; an allocation that fails (the driver
        refused pinned memory for a moment: H200, a graph capture in "global" mode on the
        engine thread) is retried after a pause, `tries` times in all. False: the fill stops
        there, and the chunks left come on demand, as they do before the fill reaches them."""
        for k in range(1, tries + 1):
            try:
                self._chunk(c, on_demand=False)
                return True
            except RuntimeError as e:
                log.warning(kv("state_host_chunk_failed", chunk=c, attempt=k, tries=tries,
                               error=repr(e)[:160]))
                if self._stop.wait(FILL_RETRY_S * k):
                    return False
        return False

    def wait_filled(self, timeout: float | None = None) -> bool:
        """Block until the background fill is done (tests, benchmarks); True when it is."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.chunks_ready == len(self._chunks)

    def close(self) -> None:
        """Stop the fill and wait for it (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        _FILLING.discard(self)
