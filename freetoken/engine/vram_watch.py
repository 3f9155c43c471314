"""The VRAM watcher: a thread that polls free device memory and asks the engine to re-plan.

Every `interval_s` (default 2 s, `ft serve --vram-watch-interval`; 0 turns the watcher off) it
reads the free memory (`torch.cuda.mem_get_info` on the engine's device; tests inject
`read_free`) and hands the reading to `submit`, which runs `ElasticVram.replan` on the engine
thread at the next safe point. The planner's hysteresis band (engine/vram_plan.py) decides
whether the reading is worth a rebuild, so a reading is cheap when nothing changed; the
watcher only keeps one re-plan queued at a time (a slow rebuild does not pile readings up).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from freetoken.log import get_logger, kv

log = get_logger("vram")
WATCH_INTERVAL_S = 2.0


def cuda_free_reader(device: torch.device) -> Callable[[], int]:
    """Free bytes on a CUDA device, as the driver counts them (every process's use)."""
    return lambda: int(torch.cuda.mem_get_info(device)[0])


class VramWatcher:
    """Polls `read_free()` every `interval_s` and calls `submit(free_bytes)`, which returns a
    `Future` done when the engine thread has re-planned. `stop()` ends the thread."""

    def __init__(self, read_free: Callable[[], int], submit: Callable[[int], Future],
                 interval_s: float = WATCH_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError("the watch interval must be positive")
        self.read_free, self.submit, self.interval_s = read_free, submit, interval_s
        self.readings = 0
        self._stop = threading.Event()
        self._queued: Future | None = None
        self._thread = threading.Thread(target=self._loop, name="ft-vram-watch", daemon=True)

    def start(self) -> VramWatcher:
        log.info(kv("watch_start", interval_s=self.interval_s))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def poll(self) -> None:
        """One reading handed to the engine (skipped while the previous one is queued)."""
        if self._queued is not None and not self._queued.done():
            return
        try:
            free = int(self.read_free())
        except Exception as e:  # noqa: BLE001  (a failed reading skips this round)
            log.warning(kv("watch_read_failed", error=repr(e)[:200]))
            return
        self.readings += 1
        self._queued = self.submit(free)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()


def attach_elastic(engine, knobs=None, interval_s: float = WATCH_INTERVAL_S,
                   read_free: Callable[[], int] | None = None, kv_floor: int | None = None,
                   rebuild_wait_s: float | None = None):
    """Give `engine` (an AsyncEngine) its `ElasticVram` and, with `interval_s > 0`, a
    started watcher (`read_free`: default the CUDA device's free memory; without CUDA and
    without a reader there is nothing to watch). Returns the ElasticVram."""
    from freetoken.engine.elastic import ElasticVram
    from freetoken.engine.vram_plan import VramKnobs

    core = engine.core
    el = ElasticVram(core, knobs or VramKnobs(), kv_floor=kv_floor)
    engine.elastic = el
    if rebuild_wait_s is not None:
        engine.rebuild_wait_s = rebuild_wait_s
    if read_free is None and core.device.type == "cuda":
        read_free = cuda_free_reader(core.device)
    if interval_s > 0 and read_free is not None:
        engine.watcher = VramWatcher(read_free, lambda free: engine.submit(el.replan, free),
                                     interval_s).start()
    log.info(kv("elastic", watch=engine.watcher is not None, interval_s=interval_s,
                kv_floor=el.kv_floor, kv_cap=el.kv_cap, min_expert_slots=el.min_expert_slots,
                hysteresis_mb=el.knobs.hysteresis_bytes // 2**20,
                margin_mb=el.knobs.margin_bytes // 2**20))
    return el
