"""The Responses -> chat mapping (freetoken/chat/responses_map.py) against the recorded Codex
session and hand-built items. Oracle for byte-stability: the real Qwen3 tokenizer and chat
template; a turn's prompt must be a token prefix of the next turn's prompt wherever Codex only
appended (it always does). Regression (issue 28): translating proxies that re-render history
non-stably swung per-turn cache hits between 14 and 98%."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken.chat import ChatInputError, ChatTokenizer, openai_to_template, qwen3_tokenizer_dir
from freetoken.chat.responses_map import input_items, items_to_messages, to_chat, tools_to_chat

TRACE = Path(__file__).parents[1] / "data" / "harness_traces" / "codex" / "codex_responses.jsonl"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen3_tokenizer_dir())


def _ids(tok: ChatTokenizer, body: dict) -> list[int]:
    chat, _ = to_chat(body, input_items(body))
    ti = openai_to_template(chat)
    return tok.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking).input_ids


def test_codex_session_renders_append_only(tok) -> None:
    recs = [json.loads(x) for x in TRACE.read_text().splitlines() if x.strip()]
    assert len(recs) == 7
    prev: list[int] | None = None
    for r in recs:
        ids = _ids(tok, r["body"])
        if prev is not None:
            assert ids[:len(prev)] == prev, f"turn {r['seq']} re-rendered earlier history"
        prev = ids


def test_one_model_turn_folds_into_one_assistant_message() -> None:
    items = [{"type": "message", "role": "developer", "content": "rules"},
             {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                              "text": "go"}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "Looking."}]},
             {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "cat", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "a"},
             {"type": "function_call_output", "call_id": "c2", "output": "b"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "again"}]},
             {"type": "message", "role": "assistant", "content": "Done."}]
    msgs = items_to_messages(items, "be brief")
    assert [m["role"] for m in msgs] == ["system", "system", "user", "assistant", "tool",
                                         "tool", "assistant"]
    a = msgs[3]
    assert a["reasoning_content"] == "think" and a["content"] == "Looking."
    assert [c["id"] for c in a["tool_calls"]] == ["c1", "c2"]
    assert msgs[6] == {"role": "assistant", "content": "Done.", "reasoning_content": "again"}


def test_tool_kinds() -> None:
    tools, names = tools_to_chat([
        {"type": "function", "name": "f", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]},
        {"type": "custom", "name": "apply_patch", "description": "patch"},
        {"type": "web_search"}])
    assert [t["function"]["name"] for t in tools] == ["f", "g", "apply_patch"]
    assert names.kind("g") == ("function", "ns") and names.kind("apply_patch")[0] == "custom"
    with pytest.raises(ChatInputError, match="not supported") as e:
        tools_to_chat([{"type": "computer"}])
    assert e.value.param == "tools[0].type"
    with pytest.raises(ChatInputError, match="duplicate"):
        tools_to_chat([{"type": "function", "name": "f"}, {"type": "function", "name": "f"}])
