"""The VRAM watcher: a timer thread that has the engine re-plan its VRAM budget.

Every `interval_s` (default 2 s, `ft serve --vram-watch-interval`; 0 turns the watcher off) it
queues one `ElasticVram.poll(read_free)` for the engine thread, which reads the free memory at
the next safe point (between steps, so the reading does not count a step's activations) and
re-plans. The planner's hysteresis band (engine/vram_plan.py) decides whether the reading is
worth a rebuild, so a poll is cheap when nothing changed; only one poll is queued at a time (a
slow rebuild does not pile readings up). On CUDA the reading is `cuda_free_reader`; tests
inject any `read_free`.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from freetoken.log import get_logger, kv

log = get_logger("vram")
WATCH_INTERVAL_S = 2.0
REBUILD_WAIT_S = 30.0  # a new request waits this long for a rebuild, then gets 503


def cuda_free_reader(device: torch.device) -> Callable[[], int]:
    """Bytes this engine could still take on a CUDA device: what the driver has free (every
    process's use counted) plus what torch's caching allocator holds unallocated."""
    def read() -> int:
        free = int(torch.cuda.mem_get_info(device)[0])
        return free + int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return read


class VramWatcher:
    """Calls `tick()` (which queues a re-plan and returns its `Future`) every `interval_s`,
    unless the previous one is still queued. `stop()` ends the thread."""

    def __init__(self, tick: Callable[[], Future], interval_s: float = WATCH_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError("the watch interval must be positive")
        self.tick, self.interval_s = tick, interval_s
        self.ticks = 0
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
        """One re-plan queued (skipped while the previous one is)."""
        if self._queued is not None and not self._queued.done():
            return
        self.ticks += 1
        self._queued = self.tick()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()


def attach_elastic(engine, knobs=None, interval_s: float = WATCH_INTERVAL_S,
                   read_free: Callable[[], int] | None = None, kv_floor: int | None = None,
                   rebuild_wait_s: float | None = None, max_expert_slots: int | None = None):
    """Give `engine` (an AsyncEngine) its `ElasticVram` and, with `interval_s > 0`, a
    started watcher (`read_free`: default the CUDA device's free memory; without CUDA and
    without a reader there is nothing to watch). `max_expert_slots`: the expert budget the
    user set (the watcher may shrink below it, never grow past it; None: the pool). Returns
    the ElasticVram."""
    from freetoken.engine.elastic import ElasticVram
    from freetoken.engine.vram_plan import VramKnobs

    core = engine.core
    el = ElasticVram(core, knobs or VramKnobs(), kv_floor=kv_floor,
                     max_expert_slots=max_expert_slots)
    engine.elastic = el
    if rebuild_wait_s is not None:
        engine.rebuild_wait_s = rebuild_wait_s
    if read_free is None and core.device.type == "cuda":
        read_free = cuda_free_reader(core.device)
    if interval_s > 0 and read_free is not None:
        engine.watcher = VramWatcher(lambda: engine.submit(el.poll, read_free),
                                     interval_s).start()
    log.info(kv("elastic", watch=engine.watcher is not None, interval_s=interval_s,
                kv_floor=el.kv_floor, kv_cap=el.kv_cap, min_expert_slots=el.min_expert_slots,
                max_expert_slots=el.max_expert_slots,
                hysteresis_mb=el.knobs.hysteresis_bytes // 2**20,
                margin_mb=el.knobs.margin_bytes // 2**20))
    return el
