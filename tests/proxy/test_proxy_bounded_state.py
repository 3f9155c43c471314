"""Issue 22 items 1 and 6 on the proxy: its per-session metrics are an LRU with a cap and an
idle expiry, `/proxy/stats` lists them a page at a time, and its keys come from the flags and
the environment the docs name, its own distinct from the upstream's.

Was: `/proxy/stats` listed every session ever seen (6.35 MB after 20,000 session ids, never
freed), and the proxy had no key of its own (`--upstream-api-key` only, on the command line)."""
from __future__ import annotations

import argparse

import httpx
import pytest
from server_helpers import Server

from freetoken.cli import build_parser
from freetoken.cli.proxy import build_config
from freetoken.proxy import metrics as metrics_mod
from freetoken.proxy.app import create_proxy_app
from freetoken.proxy.config import ProxyConfig
from freetoken.proxy.metrics import Metrics, RequestRecord


def _rec(session: str) -> RequestRecord:
    return RequestRecord("r-" + session, "generic", session, "openai", "openai",
                         "/v1/chat/completions", False, prompt_tokens=10, cached_tokens=4)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sessions_expire_when_idle_and_stay_under_the_cap(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(metrics_mod.time, "time", clock)
    m = Metrics(None, max_sessions=4, session_idle_s=60.0)
    for t, s in ((0, "a"), (30, "b"), (50, "c")):
        clock.now = 1000.0 + t
        m.record(_rec(s))
    clock.now = 1070.0  # a: 70 s idle, b: 40 s
    m.record(_rec("d"))
    assert list(m.by_session) == ["b", "c", "d"] and m.sessions_evicted == 1
    clock.now = 1075.0
    m.record(_rec("b"))  # used again: the most recent now
    m.record(_rec("e"))
    m.record(_rec("f"))  # 5 sessions > the cap of 4: the least recently used (c) goes
    assert list(m.by_session) == ["d", "b", "e", "f"] and m.sessions_evicted == 2
    assert m.by_session["b"]["requests"] == 2
    clock.now = 1075.0 + 61  # everyone idle past the expiry: the stats drop them too
    st = m.stats()
    assert st["sessions"] == {} and st["sessions_total"] == 0 and st["sessions_evicted"] == 6
    assert st["harnesses"]["generic"]["requests"] == 7  # the aggregates keep counting


def test_stats_pages_most_recent_first() -> None:
    m = Metrics(None)
    for i in range(5):
        m.record(_rec(f"s{i}"))
    st = m.stats(sessions=2, offset=1)
    assert list(st["sessions"]) == ["s3", "s2"]
    assert st["sessions_total"] == 5 and st["sessions_offset"] == 1
    assert list(m.stats(sessions=10, offset=4)["sessions"]) == ["s0"]
    assert m.stats(sessions=10, offset=9)["sessions"] == {}
    m.record(_rec("s1"))
    assert list(m.stats(sessions=1)["sessions"]) == ["s1"]


def test_stats_route_pages_and_refuses_bad_queries() -> None:
    app = create_proxy_app(ProxyConfig(upstream="http://127.0.0.1:9", upstream_api="openai",
                                       metrics_path=None))
    for i in range(60):
        app.state.proxy.metrics.record(_rec(f"s{i}"))
    srv = Server(app)
    try:
        st = httpx.get(srv.url + "/proxy/stats").json()
        assert len(st["sessions"]) == 50 and st["sessions_total"] == 60  # the default page
        st = httpx.get(srv.url + "/proxy/stats?sessions=3&offset=2").json()
        assert list(st["sessions"]) == ["s57", "s56", "s55"]
        for q in ("sessions=-1", "sessions=abc", "offset=1e3", "sessions=" + "9" * 12):
            r = httpx.get(srv.url + "/proxy/stats?" + q)
            assert r.status_code == 400 and r.json()["error"]["param"] in q, (q, r.text)
    finally:
        srv.stop()


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["agent-proxy", *argv])


def test_the_proxys_key_sources_and_the_upstreams_are_distinct(tmp_path, monkeypatch) -> None:
    own, up = tmp_path / "own", tmp_path / "up"
    own.write_text("proxy-key\n")
    up.write_text("server-key\n")
    monkeypatch.delenv("FT_API_KEY", raising=False)
    cfg = build_config(_args("--upstream", "http://u", "--api-key-file", str(own),
                             "--upstream-api-key-file", str(up)), None)
    assert (cfg.api_key, cfg.upstream_api_key) == ("proxy-key", "server-key")
    monkeypatch.setenv("FT_API_KEY", "from-env")
    cfg = build_config(_args("--upstream", "http://u", "--upstream-api-key", "k2"), None)
    assert (cfg.api_key, cfg.upstream_api_key) == ("from-env", "k2")
    with pytest.raises(SystemExit):  # one source of the proxy's key, not two
        build_config(_args("--upstream", "http://u", "--api-key", "x"), None)
    monkeypatch.delenv("FT_API_KEY")
    with pytest.raises(SystemExit):
        build_config(_args("--upstream", "http://u", "--upstream-api-key", "a",
                           "--upstream-api-key-file", str(up)), None)
    cfg = build_config(_args("--upstream", "http://u"), None)
    assert cfg.api_key is None and cfg.upstream_api_key is None
    # the in-process engine's random key is the upstream key, never the proxy's own
    cfg = build_config(_args("--api-key", "mine"), "http://localhost", engine_key="rnd")
    assert (cfg.api_key, cfg.upstream_api_key) == ("mine", "rnd")


def test_ft_ctl_takes_its_key_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    """Was: `ft ctl` took the server's key only on the command line (`ps` shows it)."""
    from freetoken.cli.ctl import _headers

    f = tmp_path / "k"
    f.write_text("ctl-key\n")
    monkeypatch.delenv("FT_API_KEY", raising=False)
    args = build_parser().parse_args(["ctl", "--api-key-file", str(f), "stats"])
    assert _headers(args) == {"Authorization": "Bearer ctl-key"}
    monkeypatch.setenv("FT_API_KEY", "env-key")
    assert _headers(build_parser().parse_args(["ctl", "stats"])) == {
        "Authorization": "Bearer env-key"}
    with pytest.raises(SystemExit):
        _headers(args)  # two sources: refused, not guessed


def test_edit_point_sessions_expire_when_idle_and_stay_under_the_cap(monkeypatch) -> None:
    """The proxy's other per-session state, the previous prompt of each session (edit
    points): bounded by a cap and an idle expiry like the metrics (it had the cap only, up to
    512 x 1.6 MB held by sessions that never come back)."""
    import freetoken.proxy.sessions as ss

    now = [1000.0]
    monkeypatch.setattr(ss.time, "monotonic", lambda: now[0])
    st = ss.SessionStore(max_sessions=3, idle_s=60.0)
    for k in "abc":
        assert st.observe_tokens(k, [1, 2, 3], [], []).kind == "new"
    now[0] += 30
    assert st.observe_tokens("a", [1, 2, 3, 4], [], []).kind == "append"  # a is fresh again
    now[0] += 40  # b and c idle 70 s > 60: they go with the next use
    assert st.observe_tokens("d", [5], [], []).kind == "new"
    assert list(st._prev) == ["a", "d"] and st.evicted == 2
    for k in "efg":  # over the cap of 3: the least recently used go first
        st.observe_tokens(k, [6], [], [])
    assert list(st._prev) == ["e", "f", "g"] and len(st) == 3 and st.evicted == 4
    assert st.observe_tokens("b", [1, 2, 3], [], []).kind == "new"  # forgotten, not an edit
