"""Running a front door until it is told to stop, then stopping what it started.

uvicorn handles SIGINT / SIGTERM with a graceful shutdown (no new connections, open responses
finished or cut at its timeout) and then *re-raises* the signal so the process dies of it:
SIGINT surfaces as a KeyboardInterrupt traceback out of `Server.run()`, SIGTERM kills the
process before any `finally`. An engine process must not die that way: its engine thread may be
inside a step (CUDA work, the native CPU bridge), and an interpreter that exits under it aborts
(`terminate called without an active exception`, exit 134, a core dump on a user's machine).

`serve_until_stopped(config, cleanup, name)` runs uvicorn with the signals captured but not
re-raised, then calls `cleanup()` (stop the engine after its current step, join its threads),
logs one `ft.server: stopped` line and returns 0. A second SIGINT still forces uvicorn's exit
(its own rule); `cleanup` runs then too.
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Generator

import uvicorn

from freetoken.log import get_logger, kv

log = get_logger("server")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StoppableServer(uvicorn.Server):
    """uvicorn.Server whose run() returns after a signal-initiated shutdown (the signals seen
    are in `signals`) instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.signals: list[str] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only (a test's server in a thread)
            return
        original = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        self.signals.append(signal.Signals(sig).name)
        self.handle_exit(sig, frame)


def serve_until_stopped(config: uvicorn.Config, cleanup: Callable[[], object],
                        name: str) -> int:
    """Serve `config` until SIGINT/SIGTERM; then `cleanup()`; exit status 0."""
    server = StoppableServer(config)
    try:
        server.run()
    finally:
        t0 = time.perf_counter()
        cleanup()
        log.info(kv("stopped", front=name, signals=",".join(server.signals) or None,
                    cleanup_s=f"{time.perf_counter() - t0:.2f}"))
    return 0
