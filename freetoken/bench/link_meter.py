"""Bytes the GPU received over PCIe during a benchmark window, from the driver's own counter:
an independent check of the expert counters' `fetch_bytes` (issue 20 item 3: offload at
90.1 tok/s with 749.9 MB a step would be 67.6 GB/s over a link that carries ~55).

NVML reports PCIe receive throughput (`nvmlDeviceGetPcieThroughput(..., RX_BYTES)`, KB/s
averaged over the driver's last ~20 ms); a thread samples it every `period_s` and integrates
rate x elapsed time between samples (`integrate`). The figure counts every byte the GPU
received (expert fills, the step's staging, anything else on the link), so it bounds the
counters from above: counters well above it are miscounted; close to it, the bytes are right
and a rate above the link's is a timing error. Needs `pynvml` (the `nvidia-ml-py` wheel); without
it or without an NVIDIA GPU, `LinkMeter.available` is False and `stop()` returns None.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

Sample = tuple[float, float]  # (time s, receive rate bytes/s)


def integrate(samples: list[Sample]) -> float:
    """Bytes over the samples' span: each interval at the mean of its two ends' rates
    (trapezoids; the driver's rate is itself a short moving average)."""
    total = 0.0
    for (t0, r0), (t1, r1) in itertools.pairwise(samples):
        total += 0.5 * (r0 + r1) * max(0.0, t1 - t0)
    return total


def nvml_rx_reader(device_index: int) -> Callable[[], float] | None:
    """A function returning the GPU's PCIe receive rate in bytes/s now, or None (no pynvml, no
    NVIDIA driver). The GPU is found by its PCI bus id, so CUDA_VISIBLE_DEVICES cannot point
    the meter at another card."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        p = torch.cuda.get_device_properties(device_index)
        bus = getattr(p, "pci_bus_id", None)
        if bus is not None:
            pci = f"{getattr(p, 'pci_domain_id', 0):08x}:{bus:02x}:{p.pci_device_id:02x}.0"
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        rx = pynvml.NVML_PCIE_UTIL_RX_BYTES
        pynvml.nvmlDeviceGetPcieThroughput(handle, rx)  # raises where unsupported
    except Exception:  # noqa: BLE001  (any failure: no meter, the bench goes on without it)
        return None
    return lambda: 1024.0 * pynvml.nvmlDeviceGetPcieThroughput(handle, rx)


class LinkMeter:
    """start() ... stop() -> bytes received over the window (None when unavailable)."""

    def __init__(self, read_rate: Callable[[], float] | None, period_s: float = 0.01,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.read_rate, self.period_s, self.clock = read_rate, period_s, clock
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.read_rate is not None

    def _sample(self) -> None:
        self.samples.append((self.clock(), self.read_rate()))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def start(self) -> None:
        if not self.available or self._thread is not None:
            return
        self.samples = []
        self._stop.clear()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="ft-link-meter", daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()
        return integrate(self.samples)
