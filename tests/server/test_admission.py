"""AsyncEngine's admission plumbing (issue 9, item 5): the one admission check of a request runs
on the engine thread, its refusal is raised by `start()` before any event, and an admitted
stream that is closed early, or dropped unclosed, aborts its request on the engine thread.

The core is a recording stand-in (AsyncEngine only needs check/add/abort/has_work/step); the
real core's checks are covered by tests/engine and tests/e2e."""
from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from freetoken.engine.async_engine import Add, AsyncEngine
from freetoken.types.api import AdmissionError, EngineEvent, GenerateRequest, SamplingParams


class RecordingCore:
    max_context = 100

    def close(self) -> None:  # the core contract: threads released at shutdown (none here)
        pass

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []  # (op, request id, thread name)
        self.emits: dict[str, object] = {}

    def check(self, req: GenerateRequest) -> None:
        self.calls.append(("check", req.request_id, threading.current_thread().name))
        if len(req.input_ids) > self.max_context:
            raise AdmissionError("too long", "messages", "context_length_exceeded")

    def add(self, req: GenerateRequest, emit: object) -> None:
        self.check(req)
        self.emits[req.request_id] = emit

    def abort(self, rid: str) -> None:
        self.calls.append(("abort", rid, threading.current_thread().name))

    def has_work(self) -> bool:
        return False


def _req(rid: str, n: int = 3) -> GenerateRequest:
    return GenerateRequest(list(range(n)), SamplingParams(max_tokens=4), request_id=rid)


@pytest.fixture()
def eng() -> AsyncEngine:
    e = AsyncEngine(RecordingCore(), None, "stub")  # type: ignore[arg-type]
    yield e
    e.shutdown()


def _wait_for(cond, timeout: float = 5.0) -> None:
    t0 = time.time()
    while not cond() and time.time() - t0 < timeout:
        time.sleep(0.01)
    assert cond()


def test_refusal_raised_by_start_after_one_check_on_engine_thread(eng: AsyncEngine) -> None:
    with pytest.raises(AdmissionError) as e:
        asyncio.run(eng.start(_req("long", 500)))
    assert e.value.code == "context_length_exceeded"
    assert eng.core.calls == [("check", "long", "ft-engine")]


def test_admitted_stream_events_and_early_close_aborts(eng: AsyncEngine) -> None:
    async def run() -> list[EngineEvent]:
        stream = await eng.start(_req("r1"))
        emit = eng.core.emits["r1"]
        emit(EngineEvent([5], prompt_tokens=3))
        first = await stream.__anext__()
        await stream.aclose()
        return [first]

    got = asyncio.run(run())
    assert got[0].token_ids == [5]
    _wait_for(lambda: ("abort", "r1", "ft-engine") in eng.core.calls)
    assert [c for c in eng.core.calls if c[0] == "check"] == [("check", "r1", "ft-engine")]


def test_finished_stream_is_not_aborted(eng: AsyncEngine) -> None:
    async def run() -> None:
        stream = await eng.start(_req("r2"))
        eng.core.emits["r2"](EngineEvent([1], True, "stop", 3))
        assert [ev.finished async for ev in stream] == [True]
        await stream.aclose()

    asyncio.run(run())
    time.sleep(0.1)
    assert ("abort", "r2", "ft-engine") not in eng.core.calls


def test_dropped_stream_aborts(eng: AsyncEngine) -> None:
    """A stream whose consumer never started (a response closed before its first event)."""
    async def run() -> None:
        await eng.start(_req("r3"))  # result dropped at once

    asyncio.run(run())
    gc.collect()
    _wait_for(lambda: ("abort", "r3", "ft-engine") in eng.core.calls)


def test_a_failing_report_does_not_end_the_engine_thread(eng: AsyncEngine) -> None:
    """Bug caught: an exception while handing a result back (a report to an event loop that
    had closed, as with two `asyncio.run` calls) killed the engine thread, so every later
    request hung. Now it is logged and the thread serves on."""
    def report(_e: object) -> None:
        raise RuntimeError("Event loop is closed")

    eng._inbox.put(Add(_req("gone"), lambda ev: None, report))
    with pytest.raises(AdmissionError):  # the thread still answers the next request
        asyncio.run(asyncio.wait_for(eng.start(_req("long", 500)), 10))
    assert eng._thread.is_alive()
    assert ("check", "long", "ft-engine") in eng.core.calls
