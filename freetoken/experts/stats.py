"""The expert counters of one model: hit rate, bytes fetched and computed on the CPU, prefill
streaming. Shared by its backends; read by `MoERuntime.stats()` (/v1/stats) and the benchmarks."""
from __future__ import annotations

import torch
from torch import Tensor


class MoEStats:
    """Counters shared by the backends of one model (hit rate, bytes moved, CPU work)."""

    def __init__(self, expert_bytes: int = 0) -> None:
        self.hits = self.misses = self.fetched = self.cpu_experts = self.steps = 0
        self.fetch_bytes = self.cpu_bytes = 0
        self.streamed = self.stream_bytes = 0  # experts / bytes moved by prefill streaming
        self.expert_bytes = expert_bytes
        # (hits, misses, fetched) summed on the device by layers that never sync (device fills);
        # folded into the host counters when read
        self._dev: Tensor | None = None
        self._dev_stream: Tensor | None = None  # (hits, misses) of streamed layers
        # experts/bw_track.py's Reprofiler when re-profiling is on: fed timed traffic samples
        self.reprofiler = None

    def add_host(self, hits: int, misses: int, fetched: int, expert_bytes: int) -> None:
        """A synced layer's decision, read on the host."""
        self.hits += hits
        self.misses += misses
        self.fetched += fetched
        self.fetch_bytes += fetched * expert_bytes
        self.cpu_experts += misses - fetched
        self.cpu_bytes += (misses - fetched) * expert_bytes

    def add_stream(self, counters: Tensor) -> None:
        """Accumulate a streamed layer's routed (hits, misses) [2] without reading them."""
        if self._dev_stream is None:
            self._dev_stream = torch.zeros(2, dtype=torch.int64, device=counters.device)
        self._dev_stream.add_(counters)

    def device_counters(self, device: torch.device) -> Tensor:
        """The running (hits, misses, fetched) [3] on `device` that decisions of layers which
        never sync add their counters to (`SlotCache.decide(accumulate=...)`: in the decision
        kernel itself); folded into the host counters by `sync`. Its address stays fixed, so
        captured steps may hold it."""
        if self._dev is None:
            self._dev = torch.zeros(3, dtype=torch.int64, device=device)
        return self._dev

    def discard_device(self) -> None:
        """Zero the device counters unread (a graph capture's warm-up routing)."""
        if self._dev is not None:
            with torch.inference_mode():
                self._dev.zero_()

    def sync(self) -> None:
        """Fold the device counters into the host ones (one device read)."""
        if self._dev_stream is not None:
            hits, miss = (int(v) for v in self._dev_stream.tolist())
            with torch.inference_mode():
                self._dev_stream.zero_()
            self.hits += hits
            self.misses += miss
        if self._dev is None:
            return
        hits, miss, fetched = (int(v) for v in self._dev.tolist())
        with torch.inference_mode():  # the counters were made inside the model's forward
            self._dev.zero_()
        self.add_host(hits, miss, fetched, self.expert_bytes)

    def as_dict(self) -> dict:
        self.sync()
        routed = self.hits + self.misses
        return {"hit_rate": round(self.hits / routed, 4) if routed else 0.0, "hits": self.hits,
                "misses": self.misses, "fetched": self.fetched, "cpu_experts": self.cpu_experts,
                "fetch_bytes": self.fetch_bytes, "cpu_bytes": self.cpu_bytes,
                "streamed": self.streamed, "stream_bytes": self.stream_bytes}
