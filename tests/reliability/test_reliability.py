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

sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import pytest
from battery import browser, flood, forgery, fuzz, slowloris
from door import door, door_faults, fd_exhaustion
from fronts import start_fault_proxy

FRONTS = ["S", "N", "U"]
# RSS growth fitted over the CI soak's 8 measured seconds (~200 requests; measured 0.0-0.4 MB
# with one malloc arena and the engine's pools resident from the start: fronts.warm_pools,
# cap_malloc_arenas): a leak of ~20 kB a request fails it
CI_RSS_FLOOR_MB = 4.0


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
    assert not door_faults(res), (door_faults(res), res)


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
