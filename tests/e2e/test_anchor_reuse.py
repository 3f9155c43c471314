"""Semantic anchors on real traffic: OpenClaw rewrites the end of its prompt every step (its
trailing context message is removed and re-appended), and Claude Code moves cache_control
forward. With state snapshots at the template's anchors, every step of the recorded sessions
reuses nearly all of the previous step's prompt on a hybrid model."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"
_HOP = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


def _cached(r: httpx.Response, path: str) -> tuple[int, int]:
    """(cached, prompt) from a JSON or SSE answer of either API."""
    text = r.text
    if path.startswith("/v1/messages"):
        for line in text.splitlines():
            if line.startswith("data: ") and '"message_start"' in line:
                u = json.loads(line[6:])["message"]["usage"]
                return u["cache_read_input_tokens"], u["input_tokens"] + u[
                    "cache_read_input_tokens"
                ]
        u = r.json()["usage"]
        return u["cache_read_input_tokens"], u["input_tokens"] + u["cache_read_input_tokens"]
    for line in reversed(text.splitlines()):
        if line.startswith("data: {") and '"usage"' in line:
            u = json.loads(line[6:]).get("usage")
            if u:
                return u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]
    u = r.json()["usage"]
    return u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]


@pytest.mark.parametrize("trace", ["openclaw/ocl_try1", "claude_code/cc_try1"])
def test_each_step_reuses_the_previous_prompt(live, trace: str) -> None:
    server, engine = live
    engine.max_output_tokens = 2
    try:
        prev = None
        ratios = []
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for line in (TRACES / f"{trace}.jsonl").read_text().splitlines():
                rec = json.loads(line)
                if ("count_tokens" in rec["path"] or "SUBAGENT-MARKER" in line
                        or not rec["body"].get("tools")):
                    continue  # token counts, sub-agents and side requests are other sessions
                body = dict(rec["body"])
                if body.get("stream"):
                    body["stream_options"] = {"include_usage": True}
                headers = {k: v for k, v in rec["headers"].items() if k.lower() not in _HOP}
                r = c.request(rec["method"], rec["path"], json=body, headers=headers)
                assert r.status_code == 200, r.text[:200]
                cached, prompt = _cached(r, rec["path"])
                if prev is not None and prompt > prev:
                    ratios.append(cached / prev)
                prev = prompt
        assert ratios, "no follow-up steps"
        # the rolling edit sits in the last few hundred tokens: resuming at the anchor before
        # it keeps the bulk of every previous prompt
        assert min(ratios) > 0.8, ratios
    finally:
        engine.max_output_tokens = None
