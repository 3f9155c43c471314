"""`server/scoped.py`: stopping work that holds a pooled connection lets its shielded cleanup
finish (issue 22's soak leak). The work here cleans up as httpcore does when it gives a
connection back: in an anyio-shielded block that awaits. The oracle is the raw
`Task.cancel()` pattern the relay used before: a second cancel landing in that block
interrupts it (the connection then stayed ACTIVE for ever)."""
from __future__ import annotations

import asyncio

import anyio

from freetoken.server.scoped import ScopedTask, unless_disconnected


def _holder(log: list[str], cleanup_s: float = 0.05):
    async def work() -> str:
        try:
            await asyncio.sleep(3600)  # a request in flight
            return "done"
        finally:
            with anyio.CancelScope(shield=True):  # httpcore: AsyncShieldCancellation
                await asyncio.sleep(cleanup_s)  # closing the connection takes a turn or two
                log.append("released")

    return work()


def test_raw_cancels_interrupt_a_shielded_cleanup() -> None:
    """The failure the module guards against, shown on the same work: the old relay's raw
    cancels (anyio re-sends them to an awaited task each loop turn) leave it unreleased."""

    async def main() -> list[str]:
        log: list[str] = []
        t = asyncio.ensure_future(_holder(log))
        await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.sleep(0.01)  # inside the shielded cleanup now
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        return log

    assert asyncio.run(main()) == []


def test_stop_lets_the_shielded_cleanup_finish() -> None:
    async def main() -> tuple[list[str], bool]:
        log: list[str] = []
        st = ScopedTask(_holder(log))
        await asyncio.sleep(0.01)
        stop = asyncio.ensure_future(st.stop())
        await asyncio.sleep(0.01)
        st.scope.cancel()  # stopped again meanwhile (a second owner giving up): no harm
        await stop
        return log, st.task.cancelled()

    log, cancelled = asyncio.run(main())
    assert log == ["released"] and cancelled


def test_result_waits_without_cancelling_the_task() -> None:
    """A waiter cancelled (by a timeout) while it waits for the task leaves the task alone:
    only `stop()` ends it."""

    async def main() -> tuple[bool, list[str]]:
        log: list[str] = []
        st = ScopedTask(_holder(log))
        with anyio.move_on_after(0.02):
            await st.result()
        alive = not st.done()
        await st.stop()
        return alive, log

    alive, log = asyncio.run(main())
    assert alive and log == ["released"]


def test_unless_disconnected_stops_its_work_through_a_scope() -> None:
    async def main(disconnect: bool) -> tuple[tuple[bool, object], list[str]]:
        log: list[str] = []
        gone = asyncio.Event()

        async def receive() -> dict:
            if disconnect:
                await asyncio.sleep(0.02)
                return {"type": "http.disconnect"}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def quick() -> str:
            return "answer"

        work = _holder(log) if disconnect else quick()
        return await unless_disconnected(receive, work), log

    (finished, res), log = asyncio.run(main(True))
    assert (finished, res) == (False, None) and log == ["released"]
    (finished, res), _ = asyncio.run(main(False))
    assert (finished, res) == (True, "answer")
