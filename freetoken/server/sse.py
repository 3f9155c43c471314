"""Server-sent events: framing, a response that aborts its producer on client disconnect, and
idle ticks for keep-alive pings.

Disconnect contract: `EventStreamResponse` watches the ASGI receive channel while it streams;
when the client goes away (or a send fails) it stops iterating and `aclose()`s the body
iterator under a shield, so the `finally` blocks down the chain (our generation driver, then the
engine's generator, which aborts the request and frees its memory) always run.

A client that stays connected but stops reading is treated the same way (the request aborted,
its slot freed, the response left unfinished, which makes uvicorn close the connection) as soon
as either holds, checked every STALL_POLL_S from the connection's `StallProbe`
(server/limits.py, on every guarded front: `ft serve` and `ft agent-proxy`):
- more than `stall_unread_bytes` (32 KiB) are queued towards it unread and it has taken none of
  them for STALL_GRACE_S (1 s: a big event to a reader on a slow link drains meanwhile;
  `rule=bytes`);
- bytes are queued and it has taken none of them for `stall_timeout_s` (30 s; `rule=time`).
Without a probe (an unguarded server) the old rule stands: one send that waited
`stall_timeout_s` (uvicorn's flow control blocks a send while the buffers are full).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from freetoken.log import get_logger, kv
from freetoken.server.scoped import ScopedTask

log = get_logger("server")
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Seconds without output after which a stream sends a keep-alive, on every route: Anthropic
# streams a `ping` event (before `message_start` too), the others an SSE comment. Claude Code's
# stall watchdog fires after ~20 s without bytes. docs/server.md states it; a test checks.
KEEPALIVE_S = 5.0
STALL_POLL_S = 0.25  # how often a stream reads its connection's StallProbe
STALL_GRACE_S = 1.0  # over the byte budget, the client must have taken nothing this long


def sse(data: Any, event: str | None = None) -> str:
    """One SSE frame; `data` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                             separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def sse_comment(text: str = "keep-alive") -> str:
    """An SSE comment line: ignored by every client parser, keeps proxies and idle timers happy."""
    return f": {text}\n\n"


PING = sse({"type": "ping"}, "ping")  # the Anthropic keep-alive event, one frame


class Tick:
    """Marker yielded by `with_ticks` after `interval` seconds without an item."""


TICK = Tick()


async def _aclose(it: Any) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


async def with_ticks(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | Tick]:
    """Yield the items of `source`, and `TICK` whenever `interval` seconds pass without one.

    The pending `__anext__` runs as its own task so that waiting on it can time out without
    cancelling it; on exit that task is stopped (through its cancel scope: `scoped.py` says
    why) and waited for before `source` is closed."""
    it = source.__aiter__()
    pending: ScopedTask | None = None

    async def next_item() -> T:
        return await it.__anext__()

    try:
        while True:
            if pending is None:
                pending = ScopedTask(next_item())
            done, _ = await asyncio.wait({pending.task}, timeout=interval)
            if not done:
                yield TICK
                continue
            task, pending = pending.task, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            if pending is not None:
                await pending.stop()
            await _aclose(it)


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that closes its body iterator when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None,
                 request_id: str = ""):
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})},
                         media_type=self.media_type)
        self.request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = completed = False
        stalled = ""  # the rule that found the client stalled
        sent = unread = 0
        probe = scope.get("extensions", {}).get("ft.stall")
        st = getattr(getattr(scope.get("app"), "state", None), "ft", None)
        stall_s = (probe.timeout_s if probe is not None
                   else float(getattr(st, "stall_timeout_s", 30.0)))

        async def timed_send(msg: Message) -> None:
            nonlocal stalled, sent
            sent += len(msg.get("body", b""))
            try:
                with anyio.fail_after(stall_s):
                    await send(msg)
            except TimeoutError:
                stalled = "send_blocked"
                raise

        async def watch_backlog() -> None:
            """The probe's two rules (module docstring); cancels the stream when one holds."""
            nonlocal stalled, unread
            t0 = time.monotonic()
            taken = -1
            while True:
                await anyio.sleep(min(STALL_POLL_S, stall_s / 4))
                b = probe.backlog()
                now = time.monotonic()
                if b == 0 or probe.written - b != taken:  # drained, or the client took some
                    taken, t0 = probe.written - b, now
                idle = now - t0  # since the client last took a byte (or had none queued)
                rule = ("bytes" if b > probe.unread_bytes and idle >= min(STALL_GRACE_S, stall_s)
                        else "time" if b > 0 and idle >= stall_s else "")
                if rule:
                    stalled, unread = rule, b
                    tg.cancel_scope.cancel()
                    return

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal disconnected
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        disconnected = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            if probe is not None:
                tg.start_soon(watch_backlog)
            try:
                await self.stream_response(timed_send)
                completed = True  # a client that hangs up after the last event is no abort
            except OSError:  # TimeoutError (a stall) included
                disconnected = True
            finally:
                with anyio.CancelScope(shield=True):
                    await _aclose(self.body_iterator)
                tg.cancel_scope.cancel()
        if stalled:
            log.info(kv("client_stalled", request=self.request_id, rule=stalled,
                        timeout_s=stall_s, bytes_sent=sent, unread=unread or None))
        elif disconnected and not completed:
            log.info(kv("client_disconnect", request=self.request_id))


async def run_unless_disconnected(receive: Receive, work: Any) -> tuple[bool, Any]:
    """Await coroutine `work` while watching for a client disconnect; on disconnect `work` is
    cancelled (its finally blocks run, aborting the engine request). Returns (finished, result).
    """
    result: list[Any] = []
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            try:
                result.append(await work)
            except Exception as e:  # noqa: BLE001 - re-raised below, outside the task group
                errors.append(e)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while True:
                if (await receive())["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(run)
        tg.start_soon(watch)
    if errors:
        raise errors[0]
    return (bool(result), result[0] if result else None)
