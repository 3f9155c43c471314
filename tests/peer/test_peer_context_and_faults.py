"""llama-cpp-python's server with a 2,048-token context behind `ft agent-proxy --upstream URL`:
its endpoints report no context, so the proxy learns it from the peer's own "maximum context
length" 400 (answered to the client in its shape) and `ft launch` then writes it; then the
peer dies, and the proxy answers each client in its own API's error shape, fast (no hang until
a timeout), streamed or not, and its record says so. The tests run in this order."""
from __future__ import annotations

import time

import httpx
import pytest
from peer_stack import ALIAS, PEER_SKIP, metrics, start_peer, start_proxy, tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(PEER_SKIP is not None,
                                                   reason=PEER_SKIP or "")]
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    _, gguf = tiny_model()
    d = tmp_path_factory.mktemp("peer_kill")
    peer = start_peer(gguf, d, n_ctx=2048)
    proxy = start_proxy(peer.url, d)
    yield peer, proxy
    proxy.stop()
    peer.stop()


def test_context_learned_from_the_peers_own_error(stack, tmp_path) -> None:
    _, proxy = stack
    from freetoken.cli import main

    st = httpx.get(proxy.url + "/proxy/stats", timeout=10).json()
    assert st["upstream_limits"]["context"] is None  # nothing in /v1/models to read
    long = [{"role": "user", "content": "word " * 3000}]
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = httpx.post(proxy.url + path, timeout=60,
                       json={"model": ALIAS, "messages": long, "max_tokens": 16})
        assert r.status_code == 400, r.text
        err = r.json()
        assert "maximum context length is 2048" in err["error"]["message"], err
        assert path == "/v1/chat/completions" or err["type"] == "error"
    st = httpx.get(proxy.url + "/proxy/stats", timeout=10).json()
    assert st["upstream_limits"]["context"] == 2048
    assert main(["launch", "claude", "--proxy", proxy.url, "--write", str(tmp_path)]) == 0
    env = (tmp_path / "claude.env").read_text()
    assert 'CLAUDE_CODE_MAX_CONTEXT_TOKENS="2048"' in env, env


def test_killed_upstream_gives_an_in_shape_error_fast(stack) -> None:
    peer, proxy = stack
    an = {"model": ALIAS, "messages": MSGS, "max_tokens": 4}
    ok = httpx.post(proxy.url + "/v1/messages", json=an, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message", ok.text
    peer.kill()
    cases = [("/v1/messages", an), ("/v1/messages", {**an, "stream": True}),
             ("/v1/chat/completions", an), ("/v1/chat/completions", {**an, "stream": True})]
    for path, body in cases:
        t0 = time.monotonic()
        r = httpx.post(proxy.url + path, json=body, timeout=30)
        took = time.monotonic() - t0
        assert took < 3.0, (path, took)
        assert 500 <= r.status_code < 600 and r.status_code != 500, (path, r.status_code, r.text)
        err = r.json()
        if path == "/v1/messages":
            assert err["type"] == "error" and err["error"]["message"], err
        else:
            assert err["error"]["message"] and err["error"]["type"], err
    recs = metrics(proxy)[-len(cases):]
    assert all(x["error"] for x in recs) and all(x["status"] >= 502 for x in recs), recs
