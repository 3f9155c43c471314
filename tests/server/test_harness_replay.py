"""Every recorded harness request (path, headers and body exactly as recorded; only the
redacted key is replaced by ours) gets a 200 with a well-formed answer in its API's shape."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_helpers import API_KEY, FakeEngine, Server, parse_sse

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"
FILES = sorted(TRACES.glob("*/*.jsonl"))
DROP = {"host", "content-length", "connection", "accept-encoding"}
REPLY_TEXT = "<think>\nThe plan.\n</think>\n\nHere is the answer."
REPLY_TOOL = ('<think>\nLook first.\n</think>\n\n<tool_call>\n{"name": "read", "arguments": '
              '{"path": "README.md"}}\n</tool_call>')

pytestmark = pytest.mark.skipif(not FILES, reason="harness traces not present")


def _headers(recorded: dict[str, str]) -> dict[str, str]:
    out = {k: v for k, v in recorded.items() if k.lower() not in DROP}
    for k, v in out.items():
        if v == "<redacted>":
            out[k] = f"Bearer {API_KEY}" if k.lower() == "authorization" else API_KEY
    return out


def _check_anthropic_stream(text: str, tool: bool) -> None:
    evs = [e for e in parse_sse(text) if e[0] not in ("#comment", "ping")]
    names = [n for n, _ in evs]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert "error" not in names
    blocks = [d["content_block"]["type"] for n, d in evs if n == "content_block_start"]
    assert names.count("content_block_stop") == len(blocks) >= 1
    stop = evs[-2][1]["delta"]["stop_reason"]
    assert stop == ("tool_use" if tool else "end_turn")
    assert blocks[-1] == ("tool_use" if tool else "text")


def _check_openai_stream(text: str, tool: bool, usage: bool) -> None:
    evs = parse_sse(text)
    assert evs[-1] == (None, "[DONE]")
    chunks = [d for _, d in evs[:-1]]
    assert all("error" not in c for c in chunks)
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
              and c["choices"][0]["finish_reason"]]
    assert finals == ["tool_calls" if tool else "stop"]
    if usage:
        assert chunks[-1]["usage"]["prompt_tokens"] > 0


def _check_responses(text: str | None, r: httpx.Response, tool: bool) -> None:
    if text is None:
        final = r.json()
    else:
        evs = [d for _, d in parse_sse(text) if isinstance(d, dict)]
        assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
        assert evs[0]["type"] == "response.created" and evs[-1]["type"] == "response.completed"
        final = evs[-1]["response"]
    kinds = [o["type"] for o in final["output"]]
    assert kinds == (["reasoning", "function_call"] if tool else ["reasoning", "message"])


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.stem}" for p in FILES])
def test_replay(server: Server, engine: FakeEngine, path: Path) -> None:
    engine.max_context = 262144  # the pruning traces grow past 100k tokens
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                tool = rec["seq"] % 2 == 1 and bool(rec["body"].get("tools"))
                engine.script = lambda req, tool=tool: REPLY_TOOL if tool else REPLY_TEXT
                r = c.request(rec["method"], rec["path"], headers=_headers(rec["headers"]),
                              content=json.dumps(rec["body"]).encode())
                where = f"{path.name} seq={rec['seq']}"
                assert r.status_code == 200, (where, r.text[:500])
                body = rec["body"]
                if rec["path"].startswith("/v1/messages/count_tokens"):
                    assert r.json()["input_tokens"] > 0
                elif rec["path"].startswith("/v1/messages"):
                    if body.get("stream"):
                        _check_anthropic_stream(r.text, tool)
                    else:
                        assert r.json()["type"] == "message"
                elif rec["path"].startswith("/v1/responses"):
                    _check_responses(r.text if body.get("stream") else None, r, tool)
                elif body.get("stream"):
                    _check_openai_stream(
                        r.text, tool, bool((body.get("stream_options") or {}).get("include_usage"))
                    )
                else:
                    ch = r.json()["choices"][0]
                    assert ch["finish_reason"] == ("tool_calls" if tool else "stop"), where
                    assert (ch["message"].get("tool_calls") if tool
                            else ch["message"]["content"] == "Here is the answer.")
                req = engine.requests[-1]
                hdrs = {k.lower(): v for k, v in rec["headers"].items()}
                want = (hdrs.get("x-claude-code-session-id") or hdrs.get("x-session-id")
                        or hdrs.get("x-session-affinity") or body.get("prompt_cache_key"))
                # lineage (#23 item 1): a sub-agent is its own session, naming its parent's
                agent = hdrs.get("x-claude-code-agent-id")
                parent = (want if agent else hdrs.get("x-parent-session-id"))
                if agent:
                    want = f"{want}/{agent}"
                assert (req.session_key, req.parent_key) == (want, parent), where
    finally:
        engine.max_context = 40960
