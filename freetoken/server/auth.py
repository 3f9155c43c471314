"""API-key checks of the front door (`guard.Guard`), shared by `ft serve` and `ft agent-proxy`.

A request is authorized when it offers the key as `Authorization: Bearer KEY` or
`x-api-key: KEY` (compared in constant time). A failed authentication is logged (client, path,
whether a key was offered; never the key) at most once per 10 s per client; past
AUTH_FAILURES_PER_MIN failures within a minute of its first one, that client's unauthenticated
requests get 429 until that minute is over (a correct key still passes). The minute is the
client's own, from its first failure: a window on the clock's minutes would let a burst across
a boundary make twice the failures, and reset a count in the middle of a burst.
"""
from __future__ import annotations

import hmac
import time

from freetoken.log import get_logger, kv
from freetoken.server.errors import APIError
from freetoken.server.limits import RateLimiter

log = get_logger("server")
AUTH_FAILURES_PER_MIN = 30


class AuthFailures:
    """Failed authentications per client address, each over the minute from its first one.
    `clock` is injectable for tests; at most MAX_CLIENTS addresses are tracked (the oldest
    windows are dropped first)."""

    WINDOW_S = 60.0
    MAX_CLIENTS = 10000

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.windows: dict[str, tuple[float, int]] = {}  # client -> (first failure, failures)
        self.log_limit = RateLimiter(10.0, clock=clock)

    def record(self, client: str, path: str, offered: bool) -> bool:
        """Count one failure; True when the client is past the limit."""
        now = self.clock()
        start, n = self.windows.pop(client, (now, 0))
        if now - start >= self.WINDOW_S:
            start, n = now, 0
        self.windows[client] = (start, n + 1)  # re-inserted: the dict stays oldest-first
        if len(self.windows) > self.MAX_CLIENTS:
            del self.windows[next(iter(self.windows))]
        dropped = self.log_limit.hit(client)
        if dropped is not None:
            log.warning(kv("auth_failed", client=client, path=path, key_offered=offered,
                           failures_this_minute=n + 1, suppressed=dropped))
        return n + 1 > AUTH_FAILURES_PER_MIN


def offered_keys(headers: dict[str, str]) -> list[str]:
    """The keys a request offers (lower-cased header names)."""
    out = [headers.get("x-api-key", "")]
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        out.append(auth[7:].strip())
    return [o for o in out if o]


def authorized(headers: dict[str, str], key: str) -> bool:
    return any(hmac.compare_digest(o.encode(), key.encode()) for o in offered_keys(headers))


def check_key(headers: dict[str, str], key: str, client: str, path: str,
              failures: AuthFailures) -> APIError | None:
    """None when authorized; else the 401 (or 429 past the failure limit) to answer."""
    if authorized(headers, key):
        return None
    offered = bool(headers.get("authorization") or headers.get("x-api-key"))
    if failures.record(client, path, offered):
        return APIError(429, "too many failed authentications from this address; retry in a "
                        "minute", None, "too_many_auth_failures")
    return APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or "
                    "'x-api-key: KEY')", None, "invalid_api_key")
