"""API-key checks of the front door (`guard.Guard`), shared by `ft serve` and `ft agent-proxy`.

A request is authorized when it offers the key as `Authorization: Bearer KEY` or
`x-api-key: KEY` (compared in constant time). A failed authentication is logged (client, path,
whether a key was offered; never the key) at most once per 10 s per client; past
AUTH_FAILURES_PER_MIN failures a minute, that client's unauthenticated requests get 429 until
the minute is over (a correct key still passes).
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
    """Failed authentications per client address over the current minute."""

    def __init__(self) -> None:
        self.window = 0
        self.counts: dict[str, int] = {}
        self.log_limit = RateLimiter(10.0)

    def record(self, client: str, path: str, offered: bool) -> bool:
        """Count one failure; True when the client is past the limit."""
        w = int(time.monotonic() // 60)
        if w != self.window or len(self.counts) > 10000:
            self.window, self.counts = w, {}
        n = self.counts[client] = self.counts.get(client, 0) + 1
        dropped = self.log_limit.hit(client)
        if dropped is not None:
            log.warning(kv("auth_failed", client=client, path=path, key_offered=offered,
                           failures_this_minute=n, suppressed=dropped))
        return n > AUTH_FAILURES_PER_MIN


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
