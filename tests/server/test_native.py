"""/ft/v1/generate (token ids in, token-id events out), /health, /v1/stats, and `ft serve`
argument parsing."""
from __future__ import annotations

import argparse

import httpx
import pytest
from server_helpers import API_KEY, MAX_CONTEXT, FakeEngine, Server, parse_sse

from freetoken.cli.serve import register

H = {"Authorization": f"Bearer {API_KEY}"}


def test_generate_streams_token_ids(server: Server, engine: FakeEngine) -> None:
    engine.script = lambda req: "native output here"
    ids = engine.tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    body = {"input_ids": ids, "session_key": "s-9",
            "sampling": {"max_tokens": 100, "temperature": 0.5, "top_k": 4},
            "anchors": [{"position": 0, "kind": "turn_start", "role": "user", "cut_point": True}]}
    r = httpx.post(server.url + "/ft/v1/generate", json=body, headers=H)
    assert r.status_code == 200
    evs = [d for n, d in parse_sse(r.text)]
    got = [t for e in evs for t in e["token_ids"]]
    eos = engine.tok.encode("<|im_end|>")[0]
    assert got == engine.tok.encode("native output here") + [eos]
    assert [e["finished"] for e in evs] == [False] * (len(evs) - 1) + [True]
    assert evs[-1]["finish_reason"] == "stop" and evs[-1]["matched_stop_id"] == eos
    assert all(e["prompt_tokens"] == len(ids) for e in evs)
    req = engine.requests[-1]
    assert req.input_ids == ids and req.session_key == "s-9"
    assert (req.anchors[0].kind, req.anchors[0].cut_point) == ("turn_start", True)
    assert req.sampling.top_k == 4 and req.sampling.stop_token_ids == engine.tok.eos_token_ids


def test_generate_clamps_and_honours_stop_ids(server: Server, engine: FakeEngine) -> None:
    engine.script = lambda req: "a b c d"
    stop = engine.tok.encode(" c")[0]
    r = httpx.post(server.url + "/ft/v1/generate", headers=H, json={
        "input_ids": [1, 2, 3], "sampling": {"max_tokens": 10**12, "stop_token_ids": [stop]}})
    assert r.headers["x-ft-max-tokens-clamped"] == str(MAX_CONTEXT - 3)
    evs = [d for _, d in parse_sse(r.text)]
    assert evs[-1]["matched_stop_id"] == stop and evs[-1]["token_ids"][-1] == stop


@pytest.mark.parametrize("body", [
    {"input_ids": []},
    {"input_ids": "abc"},
    {"input_ids": [1, -2]},
    {"input_ids": [10**9]},
    {"input_ids": [True]},
    {"input_ids": [1], "sampling": {"max_tokens": 0}},
    {"input_ids": [1], "sampling": {"stop_token_ids": ["x"]}},
    {"input_ids": [1], "sampling": []},
    {"input_ids": [1], "anchors": [{"position": 5, "kind": "head_end"}]},
    {"input_ids": [1], "anchors": [{"position": 0, "kind": "elsewhere"}]},
    {"input_ids": [1], "anchors": [{"position": 0, "kind": "head_end", "cut_point": "yes"}]},
    {"input_ids": [1], "session_key": 5},
], ids=lambda b: str(b)[:60])
def test_generate_bad_input(server: Server, engine: FakeEngine, body: dict) -> None:
    r = httpx.post(server.url + "/ft/v1/generate", json=body, headers=H)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert engine.requests == []


def test_health_reports_the_engine(server: Server, engine: FakeEngine) -> None:
    """/health names the engine's model and context, read from the engine (not configured in the
    app), so a resized or swapped engine reports itself. /v1/stats is checked against the real
    engine in tests/e2e/test_engine_paths.py."""
    h = httpx.get(server.url + "/health").json()
    assert h == {"status": "ok", "model": engine.model_name, "max_context": engine.max_context}
    engine.max_context, engine.model_name = 77, "renamed"
    try:
        h = httpx.get(server.url + "/health").json()
        assert (h["model"], h["max_context"]) == ("renamed", 77)
    finally:
        engine.max_context, engine.model_name = MAX_CONTEXT, "fake-qwen3"


def test_serve_defaults_are_the_documented_ones() -> None:
    """Every `[--flag VALUE]` default written in docs/cli.md's `ft serve` synopsis is the parser's
    default (the docs are the oracle: a changed default must change the docs with it)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    synopsis = doc.split("## `ft serve`", 1)[1].split("```", 2)[1]
    documented = dict(re.findall(r"\[(--[a-z-]+) ([0-9][0-9.]*|[a-z0-9.]+)\]", synopsis))
    assert len(documented) >= 6, documented
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    a = p.parse_args(["serve"])
    for flag, text in documented.items():
        assert str(getattr(a, flag[2:].replace("-", "_"))) == text, flag
    assert callable(a.func)
    a = p.parse_args(["serve", "--served-model-name", "a", "--served-model-name", "b",
                      "--strict-model", "--kv-tokens", "1000", "--max-context", "512"])
    assert a.served_model_name == ["a", "b"] and a.strict_model and a.kv_tokens == 1000


def test_parser_family_for(tmp_path: object) -> None:
    import json
    from pathlib import Path

    from freetoken.cli.serve import parser_family_for

    d = Path(str(tmp_path))
    assert parser_family_for(d) == "qwen3"  # no config.json
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe_text"}))
    assert parser_family_for(d) == "qwen3_5_moe"
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    assert parser_family_for(d) == "qwen3_next"
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert parser_family_for(d) == "qwen3"
