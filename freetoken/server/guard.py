"""The ASGI layer in front of the routes: who may call, what they may send, how slowly.

In order, before any route runs:
1. `Host` must name this server: a localhost name (`localhost`, `*.localhost`), a loopback
   address, the bound address, any IP literal when bound to a wildcard address, or an entry of
   `allowed_hosts` (`*` allows all). A browser reaches us under a foreign name only through DNS
   rebinding, which this refuses (403 `host_not_allowed`).
2. A request carrying an `Origin` is refused (403 `origin_not_allowed`) unless the origin's host
   passes the same test: pages on other sites cannot drive the server, even with no API key.
3. POSTs to the JSON routes (`JSON_ROUTES`) must be `application/json` (or `+json`), charset
   UTF-8 if one is named (415 `unsupported_media_type`): `text/plain` and form posts are what
   a browser sends without a CORS preflight.
4. With an API key, every path but `open_paths` (`/health`) needs it (`auth.check_key`: 401,
   429 past the failure limit), checked before any body is read.
5. A POST body is read here, whole, within `body_timeout_s` (408 `body_timeout`) and
   `max_body_bytes` (413 `body_too_large`); a client that disconnects while sending it is logged
   as one info line and gets no answer. The route then reads the buffered body.

Answers are in the path's API shape (`errors.family_of`); the connection is closed after a
refused body. Before a 413 the rest of the body is read and dropped (at most DRAIN_BYTES within
DRAIN_S): closing a socket with unread input resets the connection, and the client (a proxy in
front of us among them) would see a reset instead of the 413. A client that sent
`Expect: 100-continue` has sent nothing yet and gets the 413 at once.

The same `Guard` (with `limits.GuardedH11Protocol` under it) fronts `ft serve`, `ft agent-proxy`
and the proxy's in-process engine.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freetoken.log import get_logger, kv
from freetoken.server.auth import AuthFailures, check_key
from freetoken.server.errors import APIError, error_response, family_of
from freetoken.server.limits import RateLimiter, ServerLimits

log = get_logger("server")
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
# every POST route of `ft serve` and `ft agent-proxy` (tests/server/test_hardening.py checks
# both apps' routes against it)
JSON_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/messages",
               "/v1/messages/count_tokens", "/v1/responses", "/ft/v1/generate",
               "/ft/v1/control/experts", "/ft/v1/control/vram"}
_WILDCARD = {"", "0.0.0.0", "::"}
DRAIN_BYTES = 1 << 30
DRAIN_S = 5.0


def host_allowed(hostname: str | None, limits: ServerLimits) -> bool:
    """See the module docstring, item 1. `hostname` is without port, brackets or case."""
    if "*" in limits.allowed_hosts:
        return True
    if not hostname:
        return False
    h = hostname.lower().rstrip(".")
    if h in LOCAL_NAMES or h.endswith(".localhost") or h == limits.bound_host.lower():
        return True
    if h in (a.lower() for a in limits.allowed_hosts):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False  # a DNS name not on the list
    return ip.is_loopback or limits.bound_host in _WILDCARD


def _hostname(value: str) -> str | None:
    try:
        return urlsplit(value if "//" in value else "//" + value).hostname
    except ValueError:
        return None


def _json_type(ctype: str) -> bool:
    mime, _, params = ctype.partition(";")
    mime = mime.strip().lower()
    if not (mime == "application/json" or (mime.startswith("application/")
                                           and mime.endswith("+json"))):
        return False
    for p in params.split(";"):
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset" and v.strip().strip('"').lower() not in ("utf-8",
                                                                                   "utf8"):
            return False
    return True


class _Disconnected(Exception):
    pass


class Guard:
    """ASGI middleware applying the checks of the module docstring to every HTTP request."""

    def __init__(self, app: ASGIApp, limits: ServerLimits, api_key: str | None = None,
                 open_paths: frozenset[str] = frozenset({"/health"})) -> None:
        self.app = app
        self.limits = limits
        self.api_key = api_key
        self.open_paths = open_paths
        self.auth_failures = AuthFailures()
        self._refusals = RateLimiter(10.0)

    @property
    def state(self) -> object:
        """The wrapped app's state (what tests and the CLI reach for)."""
        return self.app.state  # type: ignore[attr-defined]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        family = family_of(scope["path"], headers)
        err = self._check_headers(scope, headers)
        if err is None and self.api_key and scope["path"] not in self.open_paths:
            client = scope["client"][0] if scope.get("client") else "?"
            err = check_key(headers, self.api_key, client, scope["path"], self.auth_failures)
        body = b""
        if err is None and scope["method"] == "POST":
            try:
                body, err = await self._read_body(receive, headers)
            except _Disconnected:
                log.info(kv("client_disconnect_mid_body", path=scope["path"],
                            client=_client(scope)))
                return
        if err is not None:
            dropped = self._refusals.hit(err.code)
            if dropped is not None:
                log.info(kv("refuse", path=scope["path"], status=err.status, code=err.code,
                            client=_client(scope), suppressed=dropped))
            extra = {"connection": "close"} if scope["method"] == "POST" else {}
            if err.status == 429:
                extra["retry-after"] = "60"
            await error_response(family, err, headers=extra or None)(scope, receive, send)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        await self.app(scope, replaying(body, receive), send)

    def _check_headers(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        host = headers.get("host")
        if host is not None and not host_allowed(_hostname(host), self.limits):
            return APIError(403, f"Host {host[:100]!r} is not allowed; this server answers "
                            "localhost names and its own address (ft serve --allowed-hosts "
                            "adds names)", None, "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not host_allowed(_hostname(origin), self.limits):
            return APIError(403, f"requests from origin {origin[:100]!r} are refused (ft serve "
                            "--allowed-hosts adds hosts)", None, "origin_not_allowed")
        if (scope["method"] == "POST" and scope["path"] in JSON_ROUTES
                and not _json_type(headers.get("content-type", ""))):
            return APIError(415, "the body must be JSON: send 'Content-Type: application/json' "
                            f"(got {headers.get('content-type', 'none')[:100]!r})", None,
                            "unsupported_media_type")
        return None

    async def _read_body(self, receive: Receive, headers: dict[str, str]
                         ) -> tuple[bytes, APIError | None]:
        cap = self.limits.max_body_bytes
        too_large = APIError(413, f"the request body is larger than {cap} bytes", None,
                             "body_too_large")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            if "100-continue" in headers.get("expect", "").lower() or int(declared) > DRAIN_BYTES:
                return b"", too_large
            await _drain(receive, self.limits.body_timeout_s)
            return b"", too_large
        chunks: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.limits.body_timeout_s) as scope:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise _Disconnected
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > cap:
                    if msg.get("more_body", False):
                        await _drain(receive, self.limits.body_timeout_s)
                    return b"", too_large
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    return b"".join(chunks), None
        assert scope.cancelled_caught
        return b"", APIError(408, f"the request body did not arrive within "
                             f"{self.limits.body_timeout_s:g} s", None, "body_timeout")


async def _drain(receive: Receive, timeout_s: float) -> None:
    """Read and drop the rest of a refused body (see the module docstring)."""
    size = 0
    with anyio.move_on_after(min(DRAIN_S, timeout_s)):
        while size < DRAIN_BYTES:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Disconnected
            size += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return


def replaying(body: bytes, receive: Receive) -> Receive:
    """An ASGI `receive` that hands over `body` whole once, then defers to `receive` (for the
    disconnect message): the request re-read after its body was consumed."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _client(scope: Scope) -> str:
    c = scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "?"
