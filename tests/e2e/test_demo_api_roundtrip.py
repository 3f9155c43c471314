"""The trained demo behind the real server (`ft serve --model demo`'s stack): a held-out
synthetic request of a recorded harness, sent in that harness's own API shape, gets a tool
call (through the server's tool parser) naming one of the request's tools with arguments its
schema accepts; sent back with the tool's result, it gets a final text answer that ends the
turn. OpenAI chat (OpenCode's request) and Anthropic messages (Claude Code's request)."""
from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from server_helpers import Server

from freetoken.chat import ChatTokenizer
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.models import demo_data as dd
from freetoken.models import demo_trained as dt
from freetoken.models.demo import demo_model_dir
from freetoken.models.loader import load_model
from freetoken.server import create_app

HELD_OUT_SEED = 23456  # the shipped weights were trained on seed 0's samples
DATA_VERSION, _ = dt.trained_data()  # held-out requests of the shipped weights' data version
MAX_TURN = 160


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    d = demo_model_dir(tmp_path_factory.mktemp("trained"))
    model = load_model(d, dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(d)
    core = EngineCore(model, tok.eos_token_ids, kv_tokens=65536, state_slots=8, max_running=2,
                      chunk_tokens=4096, max_context=65536)
    engine = AsyncEngine(core, d, "demo")
    server = Server(create_app(engine, tok, api_key=None, served_model_names=["demo"],
                               parser_family="qwen3_5_moe"))
    yield server
    server.stop()
    engine.shutdown()


def _held_out(name: str) -> tuple[dd.Harness, dict, dd.Task]:
    """The first held-out conversation of `name` whose first task uses a tool, cut before its
    first assistant message."""
    h = dd.HARNESSES[name]
    for seed in range(HELD_OUT_SEED, HELD_OUT_SEED + 50):
        body, tasks = dd.conversation(h, random.Random(seed), corpus=dd.corpus_lines(),
                                      version=DATA_VERSION)
        if tasks[0].kind != "chat":
            first = next(i for i, m in enumerate(body["messages"]) if m["role"] == "assistant")
            body["messages"] = body["messages"][:first]
            return h, body, tasks[0]
    raise AssertionError("no tool task")


def _post(server: Server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=600)
    assert r.status_code == 200, r.text[:2000]
    return r.json()


def test_openai_tool_call_round_trip(served: Server) -> None:
    """Bug this catches: the demo (or the server's qwen3 tool parser on its output) yields no
    `tool_calls`, a tool the request does not offer, arguments its schema refuses, or no final
    answer after the tool's result."""
    h, body, task = _held_out("opencode")
    req = {"model": "demo", "messages": body["messages"], "tools": body["tools"],
           "max_tokens": MAX_TURN, "temperature": 0}
    r = _post(served, "/v1/chat/completions", req)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    args = json.loads(call["arguments"])
    assert dd.tool_call_errors(body["tools"], call["name"], args) == [], call
    msgs = [*body["messages"], choice["message"],
            {"role": "tool", "tool_call_id": choice["message"]["tool_calls"][0]["id"],
             "content": h.result(task, "/home/dev/project")}]
    r2 = _post(served, "/v1/chat/completions", {**req, "messages": msgs})
    c2 = r2["choices"][0]
    assert c2["finish_reason"] == "stop" and not c2["message"].get("tool_calls"), c2
    assert (c2["message"]["content"] or "").strip(), c2
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r["usage"]["prompt_tokens"]


def test_anthropic_tool_use_round_trip(served: Server) -> None:
    """As above through /v1/messages with Claude Code's own request (19k tokens, 24 tools):
    the tool_use must name one of Claude Code's tools (the v2 demo named Codex's)."""
    h, body, task = _held_out("claude_code")
    req = {"model": "claude-opus-4-8", "max_tokens": MAX_TURN, "temperature": 0,
           **{k: body[k] for k in ("system", "tools", "thinking", "messages") if k in body}}
    r = _post(served, "/v1/messages", req)
    assert r["stop_reason"] == "tool_use", r
    use = next(b for b in r["content"] if b["type"] == "tool_use")
    schemas = {t["name"]: t["input_schema"] for t in body["tools"]}
    assert use["name"] in schemas, (use, sorted(schemas))
    schema = schemas[use["name"]]
    assert dd.schema_errors(schema, use["input"]) == [], use
    msgs = [*body["messages"], {"role": "assistant", "content": r["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                          "content": h.result(task, "/home/dev/project")}]}]
    r2 = _post(served, "/v1/messages", {**req, "messages": msgs})
    assert r2["stop_reason"] == "end_turn", r2
    assert [b["type"] for b in r2["content"]] == ["text"] and r2["content"][0]["text"].strip()
    u, u2 = r["usage"], r2["usage"]
    assert u2["cache_read_input_tokens"] >= u["input_tokens"] + u["cache_read_input_tokens"] - 8, (
        u, u2)

