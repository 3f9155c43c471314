"""Slow and hostile clients against a real uvicorn server with `ft serve`'s protocol and short
limits (issue 12, item 2): dribbled headers and bodies are cut off, connections past the cap get
a 503 and are closed, a mid-body disconnect is one info line, and a stream whose client stops
reading is aborted with its engine request."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from server_helpers import FakeEngine

from freetoken.chat import ChatTokenizer
from freetoken.server import create_app
from freetoken.server.limits import ServerLimits, quiet_connection_logs, uvicorn_config

LIMITS = ServerLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_body_bytes=4096,
                      max_connections=4, stall_timeout_s=0.5)
BODY = json.dumps({"model": "m", "max_tokens": 5,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


class LimitedServer:
    def __init__(self, app: object, limits: ServerLimits) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, limits))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started and time.time() - t0 < 10:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.connect(("127.0.0.1", self.port))
        s.settimeout(5)
        return s


@pytest.fixture(scope="module")
def slow_engine(tok: ChatTokenizer) -> FakeEngine:
    return FakeEngine(tok)


@pytest.fixture(scope="module")
def srv(slow_engine: FakeEngine, tok: ChatTokenizer) -> Iterator[LimitedServer]:
    quiet_connection_logs()
    s = LimitedServer(create_app(slow_engine, tok, api_key=None, served_model_names=["m"],
                                 limits=LIMITS), LIMITS)
    yield s
    s.server.should_exit = True
    s.thread.join(5)


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(closed by the server within `seconds`, bytes received before that)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
        return True, data
    except (TimeoutError, ConnectionResetError):
        return False, data


def head(path: str, length: int, ctype: bool = True) -> bytes:
    ct = b"content-type: application/json\r\n" if ctype else b""
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {length}\r\n".encode()
            + ct + b"\r\n")


def test_dribbled_headers_are_cut_off(srv: LimitedServer) -> None:
    """Was: 500 dribbling header senders held for 90 s, none closed."""
    idle, dribble = srv.connect(), srv.connect()
    dribble.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
    t0 = time.time()
    for s in (idle, dribble):
        closed, _ = closed_within(s, 3)
        assert closed
    assert time.time() - t0 < 2.5
    # a keep-alive connection that starts a second request and stalls is cut off too
    s = srv.connect()
    s.sendall(head("/v1/chat/completions", len(BODY)) + BODY)
    time.sleep(0.3)
    s.recv(65536)
    s.sendall(b"POST /v1/chat")
    closed, _ = closed_within(s, 3)
    assert closed


def test_dribbled_and_oversized_bodies(srv: LimitedServer, slow_engine: FakeEngine) -> None:
    slow_engine.reset()
    s = srv.connect()
    s.sendall(head("/v1/chat/completions", len(BODY)) + BODY[:10])
    closed, data = closed_within(s, 3)
    assert closed and data.startswith(b"HTTP/1.1 408") and b"body_timeout" in data
    s = srv.connect()
    s.sendall(head("/v1/messages", 10_000) + b"{")
    closed, data = closed_within(s, 3)
    assert data.startswith(b"HTTP/1.1 413") and b"request_too_large" in data  # Anthropic shape
    assert slow_engine.requests == []


def test_mid_body_disconnect_is_one_info_line(srv: LimitedServer,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Was: logged as internal_error with a traceback."""
    caplog.set_level(logging.INFO)
    s = srv.connect()
    s.sendall(head("/v1/chat/completions", len(BODY)) + BODY[:10])
    s.close()
    time.sleep(0.3)
    lines = [r for r in caplog.records if "client_disconnect_mid_body" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_connection_cap_answers_503_and_recovers(srv: LimitedServer) -> None:
    """Was: 20k half-open connections exhausted the descriptors and new requests hung. Every
    held connection here is inside a request (a body under way), so none can be evicted."""
    held = [srv.connect() for _ in range(LIMITS.max_connections)]
    for s in held:
        s.sendall(head("/v1/chat/completions", len(BODY)) + BODY[:5])
    time.sleep(0.1)
    extra = srv.connect()
    closed, data = closed_within(extra, 2)
    assert closed and data.startswith(b"HTTP/1.1 503")
    err = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert err["type"] == "error" and err["error"]["type"] == "overloaded_error"  # Anthropic
    assert err["error"]["code"] == "too_many_connections"  # OpenAI
    for s in held:
        s.close()
    time.sleep(0.1)
    r = httpx.post(srv.url + "/v1/chat/completions", content=BODY,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200


def test_half_open_flood_evicts_its_own_oldest_not_new_clients(srv: LimitedServer) -> None:
    """Was (issue 22): 512 half-open connections from one client gave every other client 503
    until the header timeout. A new connection past the cap now evicts the oldest connection
    that has sent no request, so a request still gets through."""
    held = [srv.connect() for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)
    r = httpx.post(srv.url + "/v1/chat/completions", content=BODY,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200
    closed, data = closed_within(held[0], 2)  # the oldest half-open one made room
    assert closed and data == b""
    for s in held:
        s.close()


def test_per_client_cap() -> None:
    """Connections past `max_connections_per_client` from one address evict that address's
    oldest connection without a request, else get the 503 at once."""
    from freetoken.server.limits import protocol_for

    cls = protocol_for(ServerLimits(max_connections_per_client=2))

    class T:  # the transport surface the protocol uses
        def __init__(self) -> None:
            self.sent, self.closed = b"", False

        def get_extra_info(self, name: str, default: object = None) -> object:
            return ("10.0.0.7", 5000) if name == "peername" else default

        def write(self, b: bytes) -> None:
            self.sent += b

        def close(self) -> None:
            self.closed = True

        def is_closing(self) -> bool:
            return self.closed

    import asyncio

    loop = asyncio.new_event_loop()
    try:
        from uvicorn.config import Config
        from uvicorn.server import ServerState

        state = ServerState()
        cfg = Config(app=lambda *a: None)
        cfg.load()
        ts = [T() for _ in range(3)]
        protos = [cls(cfg, state, {}, _loop=loop) for _ in ts]
        for p, t in zip(protos, ts):
            p.connection_made(t)  # type: ignore[arg-type]
            cls.fresh.pop(p, None)  # as if its request had begun: nothing to evict
        assert [t.closed for t in ts] == [False, False, True]
        assert ts[2].sent.startswith(b"HTTP/1.1 503")
        protos[0].connection_lost(None)
        t4 = T()
        p4 = cls(cfg, state, {}, _loop=loop)
        p4.connection_made(t4)  # type: ignore[arg-type]
        assert not t4.closed  # a slot came free
        t5 = T()
        p5 = cls(cfg, state, {}, _loop=loop)
        p5.connection_made(t5)  # type: ignore[arg-type]
        assert t4.closed and not t5.closed  # p4 had sent nothing: evicted for p5
        for p in protos[1:2] + [p4, p5]:
            p.connection_lost(None)
        assert cls.per_client == {}
    finally:
        loop.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_stream_client_that_stops_reading_is_aborted(srv: LimitedServer, slow_engine: FakeEngine,
                                                     caplog: pytest.LogCaptureFixture,
                                                     path: str) -> None:
    """Was: clients that never read their stream kept their decode slots to the end."""
    caplog.set_level(logging.INFO)
    slow_engine.reset()
    slow_engine.script = lambda req: "word " * 200
    # the answer must outgrow the loopback socket buffers (a few MB) before the client's stall
    # can block a send; 40k tokens of Anthropic deltas (~2 MB) can fit in them
    slow_engine.max_context = 1 << 20
    body = json.dumps({"model": "m", "max_tokens": 10**6, "ignore_eos": True, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    s = srv.connect(rcvbuf=4096)
    s.sendall(head(path, len(body)) + body)  # and never read
    t0 = time.time()
    while not slow_engine.aborted and time.time() - t0 < 20:
        time.sleep(0.05)
    assert slow_engine.aborted
    assert any("client_stalled" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    s.close()


def test_repeated_connection_errors_are_rate_limited() -> None:
    """Was: 2.9 M asyncio accept errors (194 MB of log) in 25 s when descriptors ran out."""
    from freetoken.server.limits import RateLimitFilter

    quiet_connection_logs()
    assert any(isinstance(f, RateLimitFilter) for f in logging.getLogger("asyncio").filters)
    f = RateLimitFilter(every_s=0.2)
    rec = [logging.LogRecord("asyncio", logging.ERROR, "x", 1, "socket.accept() out of system "
                             "resource", None, None) for _ in range(1001)]
    passed = [f.filter(r) for r in rec[:1000]]
    assert sum(passed) == 1
    time.sleep(0.25)
    assert f.filter(rec[1000]) and "999 more" in rec[1000].getMessage()


def _stalled_stream(slow_engine: FakeEngine, tok: ChatTokenizer, caplog: pytest.LogCaptureFixture,
                    limits: ServerLimits, delay_s: float) -> tuple[dict[str, str], float]:
    """A client with a 4 KiB receive buffer that reads nothing of a long stream: the
    `client_stalled` line's fields and the seconds from the request to the abort."""
    caplog.set_level(logging.INFO)
    slow_engine.reset()
    slow_engine.script = lambda req: "word " * 200
    slow_engine.max_context = 1 << 20
    slow_engine.delay_s = delay_s
    srv = LimitedServer(create_app(slow_engine, tok, api_key=None, served_model_names=["m"],
                                   limits=limits), limits)
    try:
        body = json.dumps({"model": "m", "max_tokens": 10**6, "ignore_eos": True,
                           "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        s = srv.connect(rcvbuf=4096)
        t0 = time.time()
        s.sendall(head("/v1/chat/completions", len(body)) + body.encode())  # and never read
        while not slow_engine.aborted and time.time() - t0 < 30:
            time.sleep(0.02)
        took = time.time() - t0
        assert slow_engine.aborted
        s.close()
    finally:
        srv.server.should_exit = True
        srv.thread.join(5)
    line = next(r.getMessage() for r in caplog.records if "client_stalled" in r.getMessage())
    return dict(f.split("=", 1) for f in line.split() if "=" in f), took


def test_a_stalled_reader_is_cut_at_the_byte_budget(slow_engine: FakeEngine,
                                                    tok: ChatTokenizer,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Was: a client that stopped reading was noticed only once a send blocked, after its
    receive window, the 64 KiB send buffer and the transport's 64 KiB had filled (~116 KB of
    unread output measured, minutes at CPU token rates). Now the bytes queued unread are
    polled: past `stall_unread_bytes`, with nothing taken for the 1 s grace, the stream is
    aborted, long before the time rule (60 s here). The stream runs at ~30 KB/s (a fast GPU's
    token rate), so the grace adds about that."""
    lim = ServerLimits(stall_timeout_s=60.0, stall_unread_bytes=8 << 10)
    f, took = _stalled_stream(slow_engine, tok, caplog, lim, delay_s=0.005)
    assert f["rule"] == "bytes" and took < 20, (f, took)
    assert 8 << 10 < int(f["unread"]) < 80 << 10, f
    assert int(f["bytes_sent"]) < 100 << 10, f  # unread + the client's 4 KiB buffer


def test_a_stalled_reader_is_cut_after_the_stall_timeout(slow_engine: FakeEngine,
                                                         tok: ChatTokenizer,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """A slow stream whose unread bytes stay under the budget: the client has taken nothing
    for `stall_timeout_s`, so it is cut then (the time bound), not when the budget fills."""
    lim = ServerLimits(stall_timeout_s=1.0, stall_unread_bytes=1 << 20)
    f, took = _stalled_stream(slow_engine, tok, caplog, lim, delay_s=0.02)
    assert f["rule"] == "time" and int(f["unread"]) < 1 << 20, f
    assert took < 15, took
