"""The request-body fuzz of tests/server, against the real engine: every body gets a 2xx or a
4xx in its API's shape, never a 5xx, and the engine keeps serving (and holds nothing) after."""
from __future__ import annotations

import json
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_errors import BODY

PATHS = ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/completions"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY, path=st.sampled_from(PATHS))
def test_fuzz_real_engine_never_5xx(live, body: dict, path: str) -> None:
    server, engine = live
    engine.max_output_tokens = 3  # valid bodies may ask for 10**20 tokens of a random model
    try:
        r = httpx.post(server.url + path, headers={"content-type": "application/json"},
                       content=json.dumps(body), timeout=60)
        assert r.status_code < 500, (r.status_code, r.text[:300], body)
        if r.status_code >= 400:
            j = r.json()
            if path.startswith("/v1/messages"):
                assert j["type"] == "error" and isinstance(j["error"]["message"], str)
            else:
                assert isinstance(j["error"]["message"], str)
        ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
        t0 = time.time()
        while engine.stats()["cache"]["running"] and time.time() - t0 < 10:
            time.sleep(0.01)
        assert engine.stats()["cache"]["kv_protected"] == 0
    finally:
        engine.max_output_tokens = None
