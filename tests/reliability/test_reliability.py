"""The reliability suite at CI size (issue 22, item 7): every battery of `battery.py` against
the three front doors S (`ft serve`), N (`ft agent-proxy` with its in-process engine) and U
(`ft agent-proxy --upstream S`) over one tiny real engine, plus the upstream-fault battery
against a scripted upstream. `scripts/reliability.py` runs the same at full size.

What each would have caught (issue 22's measurements on main e194b5d): fuzz 68/1342 5xx on N
and 145/2819 on U; 74/78 hostile browser requests answered by N/U; slowloris never closed and
half-open floods hanging the proxy with 90 MB of log; a hung upstream holding the client forever
and truncated streams reported as `end_turn`; per-session stats growing without bound."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import pytest
from battery import (
    browser,
    door,
    door_ok,
    fd_exhaustion,
    flood,
    forgery,
    fuzz,
    sessions,
    slowloris,
    upstream_faults,
)
from fronts import FAULTS, build_tiny, start_fault_proxy, start_stack, upstream_pool

FRONTS = ["S", "N", "U"]
# RSS growth fitted over the CI soak's 8 measured seconds (~200 requests; measured 0.0-0.4 MB
# with one malloc arena and the engine's pools resident from the start: fronts.warm_pools,
# cap_malloc_arenas): a leak of ~20 kB a request fails it
CI_RSS_FLOOR_MB = 4.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    s = start_stack(build_tiny(Path(tmp_path_factory.mktemp("rel")) / "tiny"))
    yield s
    s.stop()


@pytest.mark.parametrize("name", FRONTS)
def test_fuzz_no_5xx(stack, name: str) -> None:
    res = fuzz(stack.fronts[name], 40, seed=FRONTS.index(name))
    assert res.five_xx == 0 and res.bad_shape == 0, res.examples
    assert res.statuses[200] >= 5  # the mutations reach generation too, not only refusals


@pytest.mark.parametrize("name", FRONTS)
def test_hostile_browser_requests_refused(stack, name: str) -> None:
    import httpx
    from battery import browser_bodies

    f = stack.fronts[name]
    res = browser(f)
    assert res["refused"] == res["sent"], res["answered"]
    for path, body in browser_bodies().items():  # the control: sent properly, each is served
        r = httpx.post(f.url + path, content=body, timeout=60,
                       headers={**f.auth, "content-type": "application/json"})
        assert r.status_code == 200, (path, r.text[:200])


@pytest.mark.parametrize("name", FRONTS)
def test_the_doors_own_refusals(stack, name: str) -> None:
    """Issue 22 item 1 on every front: 413 for bodies over the cap (declared or as read, in
    the route's shape), 408 for a body slower than the body timeout, a client leaving
    mid-body as one info line each and no error, wrong keys answered 401 then 429 past 30 a
    minute with one `auth_failed` line and the key never logged, the right key still served.
    Was on N/U: bodies buffered without a cap, mid-body disconnects logged as internal_error
    with a traceback, no key of the proxy's own."""
    res = door(stack.fronts[name], client_ip=f"127.0.0.{10 + FRONTS.index(name)}")
    assert door_ok(res), res


@pytest.mark.parametrize("name", FRONTS)
def test_slowloris_closed_by_the_header_timeout(stack, name: str) -> None:
    res = slowloris(stack.fronts[name], 12)
    assert res["closed"] == res["opened"], res


@pytest.mark.parametrize("name", FRONTS)
def test_half_open_flood_bounded(stack, name: str) -> None:
    front = stack.fronts[name]
    res = flood(front, front.limits.max_connections * 2)
    assert res["request_ok"] and res["after_status"] == 200, res
    assert res["log_lines"] < 20, res


@pytest.mark.parametrize("name", FRONTS)
def test_descriptor_exhaustion_contained(stack, name: str) -> None:
    """The process out of descriptors (a lowered RLIMIT_NOFILE, below the connection caps):
    the front's accepts fail meanwhile (a few rate-limited lines), and it serves at once
    after."""
    res = fd_exhaustion(stack.fronts[name])
    assert res["status_after"] == 200 and res["after_s"] < 5, res
    assert res["log_lines"] < 20 and res["connect_errors"] > 0, res


@pytest.mark.parametrize("name", FRONTS)
def test_special_token_forgery_stays_text(stack, name: str) -> None:
    assert all(forgery(stack.fronts[name], stack.engine).values())


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_upstream_faults_in_shape_within_the_timeout(stack, api: str) -> None:
    """Each fault of an OpenAI and of an Anthropic upstream, to both APIs' clients (passed
    through for the upstream's own API, translated for the other), streamed and not."""
    front, mode, up = start_fault_proxy(stack.tok, api=api, first_byte_timeout_s=1.5,
                                        idle_timeout_s=1.0, total_timeout_s=4.0)
    try:
        res = upstream_faults(front, mode, ("ok", *FAULTS[:-1]), limit_s=6.0)
        t0 = time.time()  # every request given up on lets go of its upstream connection
        while upstream_pool(front).get("ACTIVE") and time.time() - t0 < 3:
            time.sleep(0.05)
        pool = upstream_pool(front)
    finally:
        front.served.stop()
        up.stop()
    bad = [r for r in res if not r["ok"]]
    assert not bad, bad
    # was: each stream given up on by the first-byte timeout left its connection ACTIVE
    # (open for ever; issue 22's soak leak, server/scoped.py)
    assert not pool.get("ACTIVE"), pool


def test_a_stream_that_never_ends_stops_at_the_total_timeout(stack) -> None:
    """Item 4's total timeout: an upstream stream that sends a chunk every 0.2 s for ever
    (never idle) ends, for both clients, with an in-band error at the total timeout."""
    import httpx

    front, mode, up = start_fault_proxy(stack.tok, first_byte_timeout_s=1.0,
                                        idle_timeout_s=1.0, total_timeout_s=2.0)
    mode["now"] = "drip"
    try:
        for path in ("/v1/chat/completions", "/v1/messages"):
            t0 = time.time()
            text = ""
            with httpx.stream("POST", front.url + path, headers=front.auth, timeout=30, json={
                    "model": "m", "max_tokens": 5, "stream": True, "messages": [
                        {"role": "user", "content": "hi"}]}) as r:
                for chunk in r.iter_text():  # (a drip is never a read timeout: bound it here)
                    text += chunk
                    if time.time() - t0 > 8:
                        break
            took = time.time() - t0
            assert r.status_code == 200 and 1.9 < took < 4.0, (path, took)
            assert " more" in text and "did not finish its reply" in text, text[-300:]
            assert "message_stop" not in text and '"finish_reason":"stop"' not in text
    finally:
        front.served.stop()
        up.stop()


def test_a_proxy_client_that_stops_reading_is_cut_and_the_upstream_closed(stack,
                                                                          caplog) -> None:
    """The slow-client rule of the door (unread bytes, the stall timeout) on the proxy: a
    streaming client that stops reading is cut (`client_stalled`), and the proxy closes its
    upstream stream (no pooled connection left ACTIVE) instead of relaying for ever."""
    import json
    import logging
    import socket

    caplog.set_level(logging.INFO)
    front, mode, up = start_fault_proxy(stack.tok)
    mode["now"] = "gush"
    try:
        body = json.dumps({"model": "m", "max_tokens": 5, "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", front.served.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                  b"authorization: Bearer " + front.key.encode() + b"\r\ncontent-type: "
                  b"application/json\r\ncontent-length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)  # and never read
        t0 = time.time()
        while time.time() - t0 < 15 and "client_stalled" not in caplog.text:
            time.sleep(0.1)
        took = time.time() - t0
        while upstream_pool(front).get("ACTIVE") and time.time() - t0 < 20:
            time.sleep(0.1)
        pool = upstream_pool(front)
        s.close()
    finally:
        front.served.stop()
        up.stop()
    assert "client_stalled" in caplog.text and took < front.limits.stall_timeout_s + 6, took
    assert not pool.get("ACTIVE"), pool


def test_the_in_process_engine_has_no_port_and_needs_its_key(stack) -> None:
    """Item 1: N's engine is reached over a Unix socket in a private directory (no TCP
    port), behind the Guard with a random key. Was: an internal TCP port with no auth, no
    header timeout and no cap, in the proxy's process."""
    import argparse
    import os
    import socket
    import stat

    import httpx

    from freetoken.cli.proxy import start_engine_server

    link, _, _ = start_engine_server(argparse.Namespace(stall_timeout=2.0), stack.engine,
                                     stack.tok, "qwen3_5_moe")
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(link.uds)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(link.uds).st_mode) == 0o600
        families = {s.family for srv in link.server.servers for s in srv.sockets}
        assert families == {socket.AF_UNIX}, families
        assert len(link.key) >= 32
        with httpx.Client(transport=httpx.HTTPTransport(uds=link.uds), timeout=30) as c:
            assert c.get(link.url + "/v1/models").status_code == 401
            assert c.get(link.url + "/v1/models",
                         headers={"authorization": "Bearer wrong"}).status_code == 401
            ok = c.get(link.url + "/v1/models", headers={"authorization": f"Bearer {link.key}"})
            assert ok.status_code == 200
            r = c.post(link.url + "/ft/v1/generate", content=b"{}", headers={
                "authorization": f"Bearer {link.key}", "content-type": "text/plain"})
            assert r.status_code == 415  # the same door: content types too
    finally:
        link.stop()


def test_refused_upstream_and_count_tokens_in_shape(stack) -> None:
    """Was: count_tokens turned a refused connection into a 500."""
    import httpx
    from fronts import KEY, Served, free_port, limits

    from freetoken.proxy.app import create_proxy_app
    from freetoken.proxy.config import ProxyConfig

    cfg = ProxyConfig(upstream=f"http://127.0.0.1:{free_port()}", api_key=KEY, metrics_path=None)
    p = Served(create_proxy_app(cfg, stack.tok, "qwen3"), limits())
    try:
        h = {"authorization": f"Bearer {KEY}"}
        body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
        for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"):
            r = httpx.post(p.url + path, json=body, headers=h, timeout=20)
            assert r.status_code == 502, (path, r.text)
            j = r.json()
            assert (j["type"] == "error") if "messages" in path else ("error" in j)
    finally:
        p.stop()


def test_upstream_that_never_accepts_times_out_in_shape(stack) -> None:
    """Item 4's connect timeout: an upstream whose listen backlog is full (its SYNs go
    unanswered, so connecting hangs) ends every request within the connect timeout, with 504
    `upstream_timeout` in the client's shape (in-band for a stream that started: `ping_s` is
    below the timeout here); count_tokens too. Was (before the relay mapped transport errors):
    an in-band 502 naming a Python exception for a stream."""
    import json
    import socket

    import httpx
    from fronts import KEY, Served, limits

    from freetoken.proxy.app import create_proxy_app
    from freetoken.proxy.config import ProxyConfig

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    held = socket.create_connection(srv.getsockname(), timeout=2)  # fills the backlog
    cfg = ProxyConfig(upstream=f"http://127.0.0.1:{srv.getsockname()[1]}",
                      upstream_api="anthropic", api_key=KEY, metrics_path=None,
                      connect_timeout_s=0.8, ping_s=0.3)
    p = Served(create_proxy_app(cfg, stack.tok, "qwen3"), limits())
    try:
        h = {"authorization": f"Bearer {KEY}"}
        body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
        for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"):
            for stream in (False, True) if "count" not in path else (False,):
                t0 = time.time()
                r = httpx.post(p.url + path, json={**body, "stream": stream}, headers=h,
                               timeout=20)
                took = time.time() - t0
                assert took < 3.0, (path, stream, took)
                if not stream:
                    assert r.status_code == 504, (path, r.text)
                    j = r.json()
                    assert (j["type"] == "error") if "messages" in path else ("error" in j)
                    assert "upstream_timeout" in r.text or "timed out" in r.text
                    continue
                assert r.status_code == 200
                if path == "/v1/messages":
                    ev = [ln for ln in r.text.splitlines() if ln.startswith("event:")]
                    assert ev[-1] == "event: error" and "message_stop" not in r.text, r.text
                    err = json.loads(r.text.split("event: error\ndata: ")[1].split("\n")[0])
                    assert "timed out" in err["error"]["message"], err
                else:
                    data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                    assert data[-1] == "[DONE]"
                    err = json.loads(data[-2])["error"]
                    assert err["code"] == "upstream_timeout", err
    finally:
        p.stop()
        held.close()
        srv.close()


def test_413_from_the_upstream_stays_413(stack) -> None:
    """Was: through U, serve's 413 became a 502 'upstream unreachable' (S reset the
    connection with the body unread). U's cap is above S's here, so S refuses."""
    import httpx

    u, s = stack.fronts["U"], stack.fronts["S"]
    big = "x" * (s.limits.max_body_bytes + 1000)
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = httpx.post(u.url + path, headers=u.auth, timeout=30, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": big}]})
        assert r.status_code == 413, r.text[:200]


def test_sessions_bounded(stack) -> None:
    front, mode, up = start_fault_proxy(stack.tok)
    mode["now"] = "ok"
    front.served.app.state.proxy.metrics.max_sessions = 50
    try:
        res = sessions(front, front.served.app, 200)
    finally:
        front.served.stop()
        up.stop()
    assert res["kept"] == 50 and res["evicted"] == 150, res
    assert res["stats_bytes"] < 60_000, res


@pytest.mark.parametrize("name", FRONTS)
def test_foreign_stream_options_on_messages(stack, name: str) -> None:
    """Found by the full-size fuzz: `stream_options` is no Anthropic field, so validation lets
    any value through on /v1/messages, and U read `.get` of a list (500)."""
    import httpx

    f = stack.fronts[name]
    r = httpx.post(f.url + "/v1/messages", headers=f.auth, timeout=60, json={
        "model": "m", "max_tokens": 2, "stream": True, "stream_options": [1],
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "message_stop" in r.text


@pytest.mark.parametrize("name", FRONTS)
def test_responses_session_keys_that_are_no_header_value(stack, name: str) -> None:
    """Found by the fuzz of /v1/responses: `prompt_cache_key` becomes the chat request's
    `x-session-id`, and U forwards that header: a NUL, newline or edge space in it (or over
    256 bytes cut inside a character) made httpx refuse the upstream request (502)."""
    import httpx

    f = stack.fronts[name]
    for key in ("\x00", "a\r\nx-injected: 1", " edge ", "\x7f", "\u00e9" * 200, "plain"):
        r = httpx.post(f.url + "/v1/responses", headers=f.auth, timeout=60, json={
            "model": "m", "input": "hi", "max_output_tokens": 2, "prompt_cache_key": key})
        assert r.status_code == 200, (key, r.text[:300])


def _answer(front, path: str, raw: bytes) -> tuple[int, str | None, str | None]:
    """(status, error type, error param) of one non-streamed request."""
    import httpx

    r = httpx.post(front.url + path, headers={**front.auth, "content-type": "application/json"},
                   content=raw, timeout=60)
    if r.status_code == 200:
        return 200, None, None
    err = r.json().get("error") or {}
    return r.status_code, err.get("type"), err.get("param")


def test_every_front_answers_a_bad_field_as_the_server_does(stack) -> None:
    """Issue 22 item 2: the proxy validates with the server's walk, so N and U give S's answer
    (status and, for a refusal, the error's type and param) for each sampling extreme and each
    tool-call `arguments` bomb, on both APIs; the sampling extremes that can be sampled
    (subnormal temperature / top_p) are answered 200 everywhere. Was: N and U replaced an
    invalid `max_tokens` ("16", 1.5, true, inf) by their cap and answered 200, and the
    arguments bombs gave 500."""
    import json

    from fuzzing import ARG_BOMBS, BASES, SAMPLING

    cases = []
    for path in ("/v1/chat/completions", "/v1/messages"):
        for k, v in SAMPLING:
            if path == "/v1/messages" and k not in ("temperature", "top_p", "top_k",
                                                    "max_tokens", "stop_sequences", "thinking"):
                continue  # (the Anthropic fields among them; the rest run on OpenAI's only)
            body = {**BASES[path], k: v}
            cases.append((path, f"{k}={v!r}"[:40], json.dumps(body).encode()))
    for bomb in ARG_BOMBS:
        body = json.loads(json.dumps(BASES["/v1/chat/completions"]))
        body["messages"][2]["tool_calls"][0]["function"]["arguments"] = bomb
        cases.append(("/v1/chat/completions", f"arguments={bomb[:20]!r}",
                      json.dumps(body).encode()))
    differ = []
    for path, what, raw in cases:
        got = {n: _answer(stack.fronts[n], path, raw) for n in FRONTS}
        # the one deliberate difference (proxy/validate.py): the proxy refuses the non-JSON
        # constants (Infinity, NaN) as JSON, naming no field; the server where it reads them
        seen = {a[:2] if b"Infinity" in raw or b"NaN" in raw else a for a in got.values()}
        if len(seen) != 1 or got["S"][0] >= 500:
            differ.append((path, what, got))
    assert not differ, differ
    for path in ("/v1/chat/completions", "/v1/messages"):
        for k, v in (("temperature", 1e-300), ("top_p", 5e-324)):
            raw = json.dumps({**BASES[path], k: v}).encode()
            assert _answer(stack.fronts["N"], path, raw)[0] == 200


@pytest.mark.parametrize("name", FRONTS)
def test_openai_stream_contract_on_every_front(stack, name: str) -> None:
    """Issue 22 item 5: a stream that did not ask for usage has no `usage` in any chunk and no
    chunk without choices (code reading `chunk.choices[0]` must not raise); one that asked
    gets one usage chunk, with `choices: []`, last before [DONE]. Was: through U every chunk
    carried `"usage": null` and an extra `choices: []` chunk came unasked."""
    _openai_stream_contract(stack.fronts[name])


def test_openai_stream_contract_through_an_anthropic_upstream(stack) -> None:
    """The same on the translated path (an OpenAI client, an Anthropic-only upstream)."""
    front, mode, up = start_fault_proxy(stack.tok, api="anthropic")
    mode["now"] = "ok"
    try:
        _openai_stream_contract(front)
    finally:
        front.served.stop()
        up.stop()


def _openai_stream_contract(f) -> None:
    import json

    import httpx

    for asked in (False, True):
        body = {"model": "m", "max_tokens": 3, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        if asked:
            body["stream_options"] = {"include_usage": True}
        r = httpx.post(f.url + "/v1/chat/completions", headers=f.auth, json=body, timeout=60)
        assert r.status_code == 200
        data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks and all("error" not in c for c in chunks)
        if not asked:
            assert all("usage" not in c and c["choices"] for c in chunks), chunks
        else:
            *body_chunks, last = chunks
            assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
            assert all(c["choices"] and c.get("usage") is None for c in body_chunks), chunks


def test_soak_at_ci_size(stack) -> None:
    """scripts/soak.py in seconds, through N, U and U* (the proxy before the scripted instant
    upstream, whose `timeout` requests it gives up on after 1 s): every kind of the mix
    answered as expected, distinct sessions counted, RSS and fds flat after the warm-up, and
    at the end no upstream connection left ACTIVE and the fds back where they were.

    Was (issue 22's 20-minute soak, fds 59 -> 111): a streamed request given up on by a
    first-byte timeout, and now and then one whose client left as its stream ended, left its
    pooled upstream connection ACTIVE for ever (a raw `Task.cancel()` interrupting httpcore's
    shielded cleanup; server/scoped.py)."""
    from soak import KINDS, soak

    u_star, mode, up = start_fault_proxy(stack.tok, first_byte_timeout_s=1.0)
    mode["now"] = "ok"
    try:
        res = soak([stack.fronts["N"], stack.fronts["U"], u_star], seconds=12.0, sample_s=0.5,
                   warm_up_s=4.0, rss_floor_mb=CI_RSS_FLOOR_MB)
    finally:
        u_star.served.stop()
        up.stop()
    assert not res["unexpected"], res
    assert {k.split(":")[0] for k in res["by_status"]} == set(KINDS), res
    assert res["sessions"] >= 3 and res["samples"] >= 10, res
    assert res["pooled_active_after"] == 0, res  # no leaked upstream connection
    assert res["fd_excess_after"] <= res["fd_slack"], res  # the fds back at the start's
    assert res["fd_fitted_growth"] <= res["fd_floor"], res
    if stack.foreign_threads == 0:  # RSS is the stack's only in a process of its own
        assert res["rss_fitted_growth_mb"] <= CI_RSS_FLOOR_MB, res
        assert res["flat"], res
    # else (a pytest worker that ran other test files first, as under xdist): their threads
    # keep malloc arenas the cap cannot reach (16 MB of growth seen there with nothing
    # retained); the fd and connection checks above are the leak's oracle, and
    # `python -m pytest tests/reliability -n 0` or scripts/soak.py measure RSS


def test_soak_verdict_tells_growth_from_noise() -> None:
    """The verdict's oracle: a series growing 1.5 MB a minute is not flat (24 MB over the 16
    minutes fitted after the warm-up > the 16 MB floor); +-4 MB of noise around a level is,
    with a step in the warm-up; one fd leaked a minute is not flat."""
    import random

    from soak import verdict

    rnd = random.Random(0)
    ts = [30.0 * i for i in range(41)]
    base = 800 * 1024
    grow = [(t, base + int(t / 60 * 1536), 40) for t in ts]
    noise = [(t, base + rnd.randint(-4096, 4096) + (0 if t > 200 else -50_000), 40) for t in ts]
    fd_leak = [(t, base, 40 + int(t / 60)) for t in ts]
    assert not verdict(grow, 240)["flat"]
    assert verdict(noise, 240)["flat"]
    assert not verdict(fd_leak, 240)["flat"]
