"""The proxy's per-request fast path: the JSON codec (orjson with a standard-library fallback)
reads and writes the same values as `json`, and the one-task disconnect watch of a non-streamed
request still cancels the upstream request when the client leaves."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from trace_replay import FILES, records
from upstream_fakes import Events, start_proxy

from freetoken.proxy import jsonc

ODD = [b'{"big": 123456789012345678901234567890, "neg": -98765432109876543210}',  # > 64 bits
       b'{"s": "\\ud800 lone surrogate"}',
       '{"u": "caf\u00e9"}'.encode("utf-16"),  # json detects UTF-16/32 bodies
       b'{"a": 1, "a": 2}']


@pytest.fixture(params=["orjson", "stdlib"])
def codec(request, monkeypatch):
    if request.param == "stdlib":
        monkeypatch.setattr(jsonc, "orjson", None)
    elif jsonc.orjson is None:
        pytest.skip("orjson is not installed")
    return request.param


def _same(a, b) -> bool:
    """Equal as JSON values (1 and 1.0 and True told apart)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_loads_reads_what_json_reads(codec) -> None:
    """Bug it would catch: a faster parser that rejects (400) or changes a body `json` took
    (orjson reads 123456789012345678901234567890 as 1.2345678901234568e+29)."""
    bodies = [path.read_bytes().splitlines()[0] for path in FILES] + ODD
    for raw in bodies:
        assert _same(jsonc.loads(raw), json.loads(raw)), raw[:80]
    for bad in (b"{", b"", b'{"a": }', b"\xff\xfe\x00", b'{"t": NaN}', b'[-Infinity]'):
        with pytest.raises(ValueError):
            jsonc.loads(bad)


def test_dumps_writes_the_same_values(codec) -> None:
    """What goes upstream parses back to the value the proxy meant, big ints and lone
    surrogates included (orjson refuses both; the fallback writes them as json did)."""
    values = [r["body"] for path in FILES for r in records(path)[:2]]
    values += [{"big": 2**70}, {"s": "\ud800"}, {"t": (1, 2)}, {"k": {"\u00e9": [1.5, True, None]}}]
    for v in values:
        out = jsonc.dumps(v)
        assert isinstance(out, bytes)
        assert _same(json.loads(out), json.loads(json.dumps(v))), str(v)[:80]


def test_canonical_ignores_key_order_only(codec) -> None:
    """The session store compares messages by this; a change it must still see."""
    assert jsonc.canonical({"a": 1, "b": [1, {"c": 2, "d": 3}]}) == jsonc.canonical(
        {"b": [1, {"d": 3, "c": 2}], "a": 1})
    for x, y in (({"a": 1}, {"a": 1.0}), ({"a": 1}, {"a": True}), ({"a": "x"}, {"a": "y"}),
                 ({"a": [1, 2]}, {"a": [2, 1]})):
        assert jsonc.canonical(x) != jsonc.canonical(y)


def test_client_leaving_a_non_streamed_request_cancels_the_upstream() -> None:
    """Bug it would catch: the one-task watch of `forward.unless_disconnected` missing the
    client's disconnect (the upstream then computes a reply nobody reads) or swallowing it
    without a record."""
    p = start_proxy({"upstream_api": "openai"})
    try:
        up = Events(['{"choices": []}'], first_delay=30)
        p.router.post("http://upstream.test/v1/chat/completions").mock(
            side_effect=lambda r: httpx.Response(200, stream=up))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(p.url + "/v1/chat/completions", json=body, timeout=0.5)
        t0 = time.time()
        while not up.closed and time.time() - t0 < 10:
            time.sleep(0.02)
        assert up.closed, "the upstream response was not closed after the client left"
        t0 = time.time()
        while p.stats()["requests"] < 1 and time.time() - t0 < 5:
            time.sleep(0.02)
        st = p.stats()
        assert st["requests"] == 1 and st["harnesses"]["generic"]["errors"] == 1
    finally:
        p.server.stop()


def test_nan_in_a_body_is_a_400_in_the_clients_shape() -> None:
    """NaN is not JSON: answered here, not written upstream as null (a NaN temperature would
    have become the default one)."""
    p = start_proxy({"upstream_api": "openai"})
    try:
        raw = b'{"model": "m", "temperature": NaN, "messages": [{"role": "user", "content": "x"}]}'
        r = httpx.post(p.url + "/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = httpx.post(p.url + "/v1/messages", content=raw.replace(b"NaN", b"Infinity"),
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert not p.seen
    finally:
        p.server.stop()
