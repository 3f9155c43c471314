"""Cancelling work that holds a pooled upstream connection, without leaking the connection.

httpcore returns a connection to its pool (or closes it) in cleanup code that it shields with
anyio cancel scopes (`AsyncShieldCancellation`). A shield stops anyio's own cancellation, not
a raw `Task.cancel()`: a raw cancel landing while that cleanup awaits (closing a response
whose body just ended, or a request given up on) interrupts it, and the connection stays
`ACTIVE` in the pool for ever with its socket open. anyio itself sends raw cancels when a
task awaits another task directly inside a cancel scope (`await task` under `fail_after`: the
awaited task is cancelled again on every loop iteration until it ends). Issue 22's 20-minute
proxy soak leaked ~1 connection a minute this way (fds 59 -> 111; `tests/reliability/soak.py`).

So work that may be stopped from outside runs in a `ScopedTask` (stopped through its own
cancel scope, which honours httpcore's shields), other tasks wait for it with `asyncio.wait`
(never `await task` or `gather`, which pass their own cancellation on to it), and
`unless_disconnected` stops its work through a scope as well.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import anyio

T = TypeVar("T")


class ScopedTask(Generic[T]):
    """`coro` as a task of its own that `stop()` cancels through an anyio cancel scope.

    Contract: the task ends cancelled (`task.cancelled()`) when stopped before `coro`
    finished; `result()` waits for it without ever cancelling it (a caller that is itself
    cancelled leaves the task running: call `stop()` in its cleanup)."""

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self.scope = anyio.CancelScope()
        self.task: asyncio.Task[T] = asyncio.ensure_future(self._run(coro))

    async def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self.scope:
            return await coro
        raise asyncio.CancelledError  # stopped: the scope caught its own cancellation

    def done(self) -> bool:
        return self.task.done()

    async def result(self) -> T:
        await asyncio.wait({self.task})
        return self.task.result()

    async def stop(self) -> None:
        """Cancel (if still running) and wait until the task has ended, cleanup included;
        its exception, if any, counts as retrieved (the owner reads `task` for it)."""
        if not self.task.done():
            self.scope.cancel()
            await asyncio.wait({self.task})
        if not self.task.cancelled():
            self.task.exception()


async def unless_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]
                              ) -> tuple[bool, T | None]:
    """`await work` in this task while one watcher task waits for the client's
    `http.disconnect` and, if it comes first, cancels `work` through a cancel scope (closing
    the upstream request; see the module docstring for why not `Task.cancel()`). Returns
    (finished, result). The non-streamed hop's version of
    `freetoken.server.sse.run_unless_disconnected`, with one task instead of a task group of
    two: the event-loop round trips are a measurable share of the proxy's added latency."""
    gone = False
    result: T | None = None
    with anyio.CancelScope() as scope:

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            scope.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            result = await work
        finally:
            watcher.cancel()  # (the watcher holds no connection: a raw cancel is safe)
    if gone and scope.cancelled_caught:
        return False, None
    return True, result
