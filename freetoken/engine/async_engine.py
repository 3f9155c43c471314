"""AsyncEngine: EngineCore on a background thread, one asyncio queue per request.

The thread bridge is one inbox of typed messages (`Add`, `Abort`, `Call`, `Stop`), drained by
the engine thread between steps. `start(req)` hands the request to the engine thread, which
admits it (`EngineCore.add`, whose `check` is the one admission check of a request) and reports
the result back: the caller gets `AdmissionError` before anything was sent to its client, or an
`EventStream`. Closing that stream before the request finished (client disconnect, cancelled
task) aborts the request in the core, which frees its KV and state; so does dropping it
unclosed. `generate()` is `start` plus iteration, as one async generator.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from freetoken.engine.core import EngineCore
from freetoken.engine.elastic import ElasticVram
from freetoken.engine.vram_watch import REBUILD_WAIT_S, VramWatcher
from freetoken.log import get_logger, kv
from freetoken.types.api import AdmissionError, EngineBusy, EngineEvent, GenerateRequest

log = get_logger("engine")
_ids = itertools.count(1)
T = TypeVar("T")


@dataclass(frozen=True)
class Add:
    """Admit `req`; its events go to `emit`, the admission result (None or the error) to
    `report` (both called on the engine thread)."""
    req: GenerateRequest
    emit: Callable[[EngineEvent], None]
    report: Callable[[BaseException | None], None]


@dataclass(frozen=True)
class Abort:
    """Abort request `request_id` (its client went away), if it is still there."""
    request_id: str


@dataclass(frozen=True)
class Call:
    """Run `fn(*args, **kwargs)` between two steps; `future` gets its result or error."""
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    future: Future = field(default_factory=Future)


@dataclass(frozen=True)
class Stop:
    """End the engine thread after the step it is in."""


Message = Add | Abort | Call | Stop


class AsyncEngine:
    def __init__(self, core: EngineCore, model_dir: Path, model_name: str):
        self.core = core
        self.model_dir = model_dir
        self.model_name = model_name
        self.max_context = core.max_context
        self.max_output_tokens: int | None = None  # server-side ceiling on max_tokens
        self.tokenizer = None  # the ChatTokenizer `build_engine` loaded (None: load your own)
        # elastic VRAM (engine/elastic.py, attached by engine/elastic_setup.py): the rebuild
        # controller, its watcher, and how long a new request waits out a rebuild before 503
        self.elastic: ElasticVram | None = None
        self.watcher: VramWatcher | None = None
        self.rebuild_wait_s = REBUILD_WAIT_S
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ft-engine", daemon=True)
        self._stop = False
        self.warm_up_idle = False  # `begin_warm_up` plans the idle warm-up (cli/build.py)
        warmup = getattr(core, "warmup", None)
        if warmup is not None:  # a warm-up request gives way to a request (or the stop)
            warmup.should_yield = self._request_waiting
        self._thread.start()

    def _request_waiting(self) -> bool:
        """Whether a request (or the stop) waits in the inbox: what a warm-up step gives way
        to. Control calls do not count: `/v1/stats` polled every second made every warm-up
        task longer than a second give way for ever (H200, a first start: the 2048- and
        4096-token prefill tasks yielded 40 times each, the warm-up never finished); a call
        waits for the task in flight (a few seconds at most) instead."""
        with self._inbox.mutex:
            return any(isinstance(m, (Add, Stop)) for m in self._inbox.queue)

    # -- EngineClient ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The model's (padded) vocabulary: token-id prompts are bounded by it."""
        return self.core.cfg.vocab_size

    def check(self, req: GenerateRequest) -> None:
        """The admission check, on the caller's thread (for callers without an event loop;
        `start` runs it on the engine thread)."""
        self.core.check(req)

    async def start(self, req: GenerateRequest) -> EventStream:
        """Admit `req` on the engine thread; raises its `AdmissionError`, else returns the
        stream of its events."""
        if not req.request_id:
            req.request_id = f"req-{next(_ids)}"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        admitted: asyncio.Future = loop.create_future()

        def emit(ev: EngineEvent) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        def report(err: BaseException | None) -> None:
            loop.call_soon_threadsafe(lambda: admitted.done() or admitted.set_result(err))

        self._inbox.put(Add(req, emit, report))
        try:
            err = await self._admission(admitted)
        except BaseException:  # cancelled while waiting: the request may be admitted by now
            self._inbox.put(Abort(req.request_id))
            raise
        if err is not None:
            raise err
        return EventStream(self._inbox, req.request_id, q)

    async def _admission(self, admitted: asyncio.Future) -> BaseException | None:
        """The admission result; while an elastic rebuild holds the engine thread the request
        waits up to `rebuild_wait_s`, then is withdrawn with `EngineBusy` (a 503)."""
        while True:
            done, _ = await asyncio.wait({admitted}, timeout=self.rebuild_wait_s)
            if done:
                return admitted.result()
            el = self.elastic
            if el is not None and el.rebuilding.is_set():  # (`start` withdraws it)
                raise EngineBusy(f"the engine is rebuilding its GPU buffers (elastic VRAM) "
                                 f"for more than {self.rebuild_wait_s:g} s; retry",
                                 max(1, round(self.rebuild_wait_s)))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        stream = await self.start(req)
        try:
            async for ev in stream:
                yield ev
        finally:
            await stream.aclose()

    def stats(self) -> dict:
        out = self.core.snapshot_stats()
        if self.elastic is not None:
            out["vram"] = self.elastic.stats()
        return out

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        """Queue `fn(*args, **kwargs)` for the engine thread between two steps (a safe point
        for anything that changes the engine's buffers); the Future gets its result or error."""
        msg = Call(fn, args, kwargs)
        self._inbox.put(msg)
        return msg.future

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`submit`, awaited."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    async def resize_experts(self, **spec: Any) -> dict:
        return await self.call(self.core.resize_experts, **spec)

    def begin_warm_up(self) -> None:
        """Plan the warm-up tasks on the engine thread when `warm_up_idle` is set; from then
        on they run one at a time whenever the engine is idle (engine/warm_up.py)."""
        if self.warm_up_idle:
            self.warm_up_idle = False
            self._inbox.put(Call(self.core.warmup.plan))

    async def rebuild_vram(self, **spec: Any) -> dict:
        """`ElasticVram.rebuild` on the engine thread (/ft/v1/control/vram)."""
        if self.elastic is None:
            raise AdmissionError("elastic VRAM is off on this server", None, "not_supported")
        return await self.call(self.elastic.rebuild, **spec)

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        """Stop the engine thread after the step it is in (a warm-up task or a batch step),
        then the core's own threads: the process can exit without a thread still inside CUDA
        or the native CPU bridge. True when the engine thread has stopped within `timeout_s`
        (then the core is closed too)."""
        if self.watcher is not None:
            self.watcher.stop()
        self._stop = True
        self._inbox.put(Stop())
        self._thread.join(timeout=timeout_s)
        stopped = not self._thread.is_alive()
        if stopped:
            self.core.close()
        else:
            log.warning(kv("shutdown_engine_busy", waited_s=timeout_s))
        return stopped

    # -- engine thread -----------------------------------------------------------------------

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while True:
            try:
                self._handle(msg)
            except Exception as e:  # noqa: BLE001  (one message's failure never ends the thread)
                # e.g. a report to an event loop that has closed since (the caller is gone)
                log.warning(kv("inbox_op_failed", op=type(msg).__name__.lower(),
                               error=repr(e)[:200]))
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Add):
            try:
                self.core.add(msg.req, msg.emit)
            except Exception as e:  # noqa: BLE001  (refused or failed: report, never crash)
                msg.report(e)
            else:
                msg.report(None)
        elif isinstance(msg, Abort):
            self.core.abort(msg.request_id)
        elif isinstance(msg, Call):
            try:
                msg.future.set_result(msg.fn(*msg.args, **msg.kwargs))
            except Exception as e:  # noqa: BLE001  (handed to the caller)
                msg.future.set_exception(e)

    def _loop(self) -> None:
        while not self._stop:
            # warm-up tasks run only while idle (a core without a warm-up queue has none)
            warmup = getattr(self.core, "warmup", None)
            idle_work = warmup is not None and warmup.pending > 0
            self._drain(block=not self.core.has_work() and not idle_work)
            if not self.core.has_work():
                if idle_work and not self._stop:
                    self._warm_up_one()
                continue
            try:
                self.core.step()
            except Exception as e:  # noqa: BLE001  (a bug fails the requests in flight, not the server)
                log.error(kv("step_failed", error=repr(e)) + "\n" + traceback.format_exc())
                for r in list(self.core.sched.running) + list(self.core.sched.waiting):
                    self.core.abort(r.rid)
                    r.emit(RuntimeError(f"engine step failed: {e!r}"))  # type: ignore[arg-type]

    def _warm_up_one(self) -> None:
        """One warm-up task (engine/warm_up.py) at this safe point: a request that arrives
        meanwhile waits for this task only. A task that fails is logged and the rest go on."""
        try:
            self.core.warmup.run_one()
        except Exception as e:  # noqa: BLE001  (warm-up is an optimisation: never fatal)
            log.error(kv("warm_up_task_failed", error=repr(e)[:300]) + "\n"
                      + traceback.format_exc())


class EventStream:
    """The events of one admitted request (async iterator). `aclose()` before the last event,
    or dropping it unclosed, aborts the request on the engine thread."""

    def __init__(self, inbox: queue.Queue, request_id: str, q: asyncio.Queue) -> None:
        self._inbox, self.request_id, self._q = inbox, request_id, q
        self._over = False  # finished, failed, or closed: nothing left to abort

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> EngineEvent:
        if self._over:
            raise StopAsyncIteration
        ev = await self._q.get()
        if isinstance(ev, BaseException):  # the step failed; the core aborted the request
            self._over = True
            raise ev
        self._over = ev.finished
        return ev

    async def aclose(self) -> None:
        self._abort()

    def _abort(self) -> None:
        if not self._over:
            self._over = True
            self._inbox.put(Abort(self.request_id))

    def __del__(self) -> None:  # a stream dropped before its consumer started (a raced close)
        self._abort()
