"""Every recorded request of every harness (path, headers and body as recorded) against the
real engine: a 200 and a well-formed answer, no error. The server caps output at a few tokens
(`--max-output-tokens`) so random weights that never emit EOS end quickly. oc_prune replays a
subset (its requests grow to 144k tokens: the whole trace took 281 s of a 2-core CI run): the
first three and the prune request, the same subset as tests/proxy/test_proxy_adapters.py;
cc_compact its first request, the compaction request, the one after it and a re-sent
sub-agent (its other requests are cc_try1's shapes again)."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"
FILES = sorted(TRACES.glob("*/*.jsonl"))
_HOP = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
SUBSET = {"oc_prune": {1, 2, 3, 13}, "cc_compact": {1, 11, 12, 13}}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_recorded_requests_get_well_formed_answers(live, path: Path) -> None:
    server, engine = live
    engine.max_output_tokens = 4
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            keep = SUBSET.get(path.stem)
            for rec in _records(path):
                if keep is not None and rec["seq"] not in keep:
                    continue
                headers = {k: v for k, v in rec["headers"].items() if k.lower() not in _HOP}
                r = c.request(rec["method"], rec["path"], json=rec["body"], headers=headers)
                assert r.status_code == 200, (rec["seq"], r.text[:300])
                body = rec["body"]
                if rec["path"].startswith("/v1/responses"):  # Codex: every event is typed
                    last = json.loads(r.text.rstrip().rsplit("\n", 1)[-1][6:])
                    assert last["type"] == "response.completed", r.text[-300:]
                    continue
                if body.get("stream"):
                    assert "data:" in r.text and '"error"' not in r.text, r.text[:300]
                    continue
                out = r.json()
                if rec["path"].startswith("/v1/messages/count_tokens"):
                    assert out["input_tokens"] > 0
                elif rec["path"].startswith("/v1/messages"):
                    assert out["type"] == "message" and out["content"] is not None
                    assert out["usage"]["output_tokens"] >= 1
                else:
                    assert out["choices"][0]["message"]["role"] == "assistant"
                    assert out["usage"]["completion_tokens"] >= 1
    finally:
        engine.max_output_tokens = None
