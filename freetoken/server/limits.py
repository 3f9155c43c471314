"""Connection-level limits of `ft serve`, where uvicorn has no knob, and rate-limited logs.

What uvicorn gives and what it does not (0.54, h11 protocol):
- `timeout_keep_alive` closes a connection idle *between* requests; but a client that sends one
  byte of a request cancels that timer, and there is no timer at all before the first byte or
  while headers dribble in. `GuardedH11Protocol` adds one: a request's headers must be complete
  within `header_timeout_s` of its first byte (of the connection, for the first request), else
  the connection is closed.
- `limit_concurrency` answers 503 only once a *request* arrives; half-open connections that never
  send one still hold a file descriptor each. `GuardedH11Protocol` caps connections per client
  address (`max_connections_per_client`) and in all (`max_connections`). Past the global cap a
  new connection first evicts the oldest connection that has not sent a request yet (a flood of
  half-open connections then only pushes out its own, not everyone else's connection); if there
  is none, the new one gets a 503 in a shape both SDK families parse and is closed. Past the
  per-address cap the same holds among that address's connections.
- `h11_max_incomplete_event_size` caps the header size (uvicorn's default, 16 KiB, is kept).
- Body read time, body size, and clients that stop reading a stream are handled in the ASGI
  layer (`guard.py`, `sse.py`), where the request is known. Each request's scope carries a
  `StallProbe` (`scope["extensions"]["ft.stall"]`): the bytes queued towards the client that it
  has not taken — the transport's buffer plus the kernel's send queue (unsent or not yet
  acknowledged) — and the limits a stream holds them to: more than `stall_unread_bytes`
  (default 32 KiB), or any for `stall_timeout_s` (default 30 s) without the client taking a
  byte, and the stream is aborted (sse.EventStreamResponse). What the client's own kernel holds
  unread (its receive buffer, at most its SO_RCVBUF; ~64 KiB by Linux's default) comes on top
  and is the client's to bound. The send buffer is set to SEND_BUFFER so that what the kernel
  queues stays small next to the budget.

Repeated connection-level errors (accept failures when descriptors run out, invalid HTTP,
timeouts) are logged at most once per `RateLimitFilter.every_s` per message, with the number
suppressed since.
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import socket
import struct
import termios
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from freetoken.log import get_logger, kv

log = get_logger("server")
SEND_BUFFER = 64 << 10  # bytes; the kernel doubles it for its bookkeeping


@dataclass
class ServerLimits:
    """Limits of one server; `ft serve` flags of the same names set them."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_body_bytes: int = 64 << 20
    max_connections: int = 512
    max_connections_per_client: int = 256  # by client IP address (all local clients share one)
    stall_timeout_s: float = 30.0  # a stream whose client takes nothing this long is aborted
    stall_unread_bytes: int = 32 << 10  # ... or that has more than this queued unread
    keep_alive_s: float = 75.0
    bound_host: str = "127.0.0.1"
    allowed_hosts: list[str] = field(default_factory=list)


class StallProbe:
    """A request's view of its connection for stall detection (module docstring). It stands
    in for the transport in uvicorn's request cycle, counting the bytes written (`written`:
    headers and chunk framing included, so that `written - backlog()` is what the client has
    taken), and passes everything else through."""

    def __init__(self, transport: asyncio.Transport, limits: ServerLimits) -> None:
        self.transport = transport
        self.timeout_s = limits.stall_timeout_s
        self.unread_bytes = limits.stall_unread_bytes
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def backlog(self) -> int:
        """Bytes written towards the client that it has not taken: the transport's buffer
        plus the kernel's send queue (TIOCOUTQ: unsent or unacknowledged)."""
        n = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        # (TCP only: a Unix socket's queue counts buffer overhead, not bytes)
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ,
                                                    b"\0\0\0\0"))[0]
            except (OSError, ValueError):  # closed, or not a socket with a send queue
                pass
        return n


class RateLimiter:
    """At most one event per key per `every_s`; `hit` returns how many were dropped since the
    last one let through, or None to drop this one."""

    def __init__(self, every_s: float = 10.0, max_keys: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.max_keys = max_keys
        self.clock = clock
        self._last: dict[Any, float] = {}
        self._dropped: dict[Any, int] = {}

    def hit(self, key: Any) -> int | None:
        now = self.clock()
        if now - self._last.get(key, -1e18) < self.every_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return None
        if len(self._last) >= self.max_keys:  # a flood of distinct keys must not grow memory
            self._last.clear()
            self._dropped.clear()
        self._last[key] = now
        return self._dropped.pop(key, 0)


# What uvicorn says when an app leaves a response unfinished: ours do only when a stream's
# client stopped reading (sse.EventStreamResponse logs `client_stalled` for it), so it is noise.
UNFINISHED = "ASGI callable returned without completing response."


class RateLimitFilter(logging.Filter):
    """Lets each message template through once per `every_s`, noting how many were dropped."""

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__()
        self.limiter = RateLimiter(every_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == UNFINISHED:
            return False
        dropped = self.limiter.hit((record.name, str(record.msg)[:120]))
        if dropped is None:
            return False
        if dropped:
            record.msg = f"{record.msg} (and {dropped} more like it, not logged)"
        return True


_conn_log = RateLimiter(10.0)


def _log_limited(event: str, **fields: Any) -> None:
    dropped = _conn_log.hit(event)
    if dropped is not None:
        log.warning(kv(event, **fields, suppressed=dropped))


_OVERLOADED = json.dumps({  # both shapes at once: OpenAI reads error.*, Anthropic type + error.type
    "type": "error", "error": {"type": "overloaded_error", "code": "too_many_connections",
                               "param": None,
                               "message": "too many open connections; retry shortly"}}).encode()


_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
            + str(len(_OVERLOADED)).encode() + b"\r\n\r\n" + _OVERLOADED)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and connection caps (per client address and
    in all). `per_client` and `fresh` (connections without a request yet, oldest first) are
    per server: `protocol_for` gives each server its own class."""

    limits = ServerLimits()  # replaced per server by `protocol_for`
    per_client: ClassVar[dict[str, int]] = {}
    fresh: ClassVar[OrderedDict[GuardedH11Protocol, None]] = OrderedDict()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._addr = self.client[0] if self.client else "?"
        lim = self.limits
        n = self.per_client.get(self._addr, 0)
        if n >= lim.max_connections_per_client:
            if not self._evict_fresh(self._addr):
                self._refuse("max_connections_per_client", n, lim.max_connections_per_client)
                return
            n = self.per_client.get(self._addr, 0)
        if len(self.connections) > lim.max_connections and not self._evict_fresh():
            self._refuse("max_connections", len(self.connections), lim.max_connections)
            return
        self.per_client[self._addr] = n + 1
        self._counted = True
        self.fresh[self] = None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:  # not a TCP socket (tests on pipes); nothing to bound
                pass
        self._arm_header_timer()

    def _refuse(self, reason: str, open_: int, limit: int) -> None:
        self._counted = False
        _log_limited("connection_refused", reason=reason, client=self._addr, open=open_,
                     limit=limit)
        self.transport.write(_REFUSAL)
        self.transport.close()

    def _evict_fresh(self, addr: str | None = None) -> bool:
        """Close the oldest connection (from `addr`, when given) that has sent no request yet;
        False when there is none. It stops counting at once (its connection_lost comes
        later)."""
        victim = next((p for p in self.fresh if p is not self
                       and (addr is None or p._addr == addr)), None)
        if victim is None:
            return False
        del self.fresh[victim]
        _log_limited("connection_evicted", reason="max_connections" if addr is None else
                     "max_connections_per_client", client=victim._addr,
                     open=len(self.connections))
        victim.transport.close()
        self.connections.discard(victim)
        victim._uncount()
        return True

    def _uncount(self) -> None:
        if getattr(self, "_counted", False):
            self._counted = False
            left = self.per_client.get(self._addr, 1) - 1
            if left > 0:
                self.per_client[self._addr] = left
            else:
                self.per_client.pop(self._addr, None)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                      self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._idle() and not self.transport.is_closing():
            _log_limited("header_timeout", client=self.client, after_s=self.limits.header_timeout_s)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._idle():  # the first bytes of a next request start its header clock
            self._arm_header_timer()
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers are complete
            self._disarm_header_timer()
            self.fresh.pop(self, None)
            if self.cycle is not None:  # (the app's task has not started yet)
                probe = StallProbe(self.transport, self.limits)
                self.cycle.transport = probe  # type: ignore[assignment]
                self.cycle.scope.setdefault("extensions", {})["ft.stall"] = probe

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._idle():
            self._disarm_header_timer()  # idle from here on is keep-alive's business

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.fresh.pop(self, None)
        self._uncount()
        super().connection_lost(exc)


def protocol_for(limits: ServerLimits) -> type[GuardedH11Protocol]:
    return type("GuardedH11", (GuardedH11Protocol,),
                {"limits": limits, "per_client": {}, "fresh": OrderedDict()})


def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits,
                   log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                          http=protocol_for(limits), timeout_keep_alive=int(limits.keep_alive_s))


def quiet_connection_logs(every_s: float = 10.0) -> None:
    """Rate-limit the loggers that repeat per connection: asyncio's (accept failures when
    descriptors run out) and uvicorn's (invalid HTTP, protocol errors)."""
    for name in ("asyncio", "uvicorn.error"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in lg.filters):
            lg.addFilter(RateLimitFilter(every_s))
