"""`offload`: fetch every miss into the slot cache and compute everything from slots.

With fills driven by the device (pinned store and Triton on CUDA, or the CPU device in tests)
a step issues no host sync and can be captured; otherwise it takes the one-sync path. A step
that routes more distinct experts than the cache holds sends the overflow to the CPU branch
(through the bridge in captured steps), which is why offload is a `CpuSplitExperts` whose rule
fetches everything.
"""
from __future__ import annotations

from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.split import CpuSplitExperts, FixedRule
from freetoken.experts.store import ExpertStore


class OffloadExperts(CpuSplitExperts):
    def __init__(self, moe_index: int, cache: SlotCache, store: ExpertStore, stats,
                 cpu_threads: int | None = None, streamer=None):
        super().__init__("offload", moe_index, cache, store, stats, FixedRule(-1),
                         cpu_threads, streamer)
        self._device_fill: bool | None = None  # decided on first use

    @property
    def device_fill(self) -> bool:
        """Fills driven by the device: no host sync in the layer, capturable."""
        if self._device_fill is None:
            self._device_fill = self.cache.can_fill_on_device(self.store)
        return self._device_fill
