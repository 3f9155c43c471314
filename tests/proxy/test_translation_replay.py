"""Every recorded harness session (tests/data/harness_traces, Codex's Responses session
included) through every translation path the proxy takes — Anthropic -> OpenAI chat, OpenAI
chat -> Anthropic, each round trip, Responses -> chat and Responses -> chat -> Anthropic —
rendered with the real Qwen3 template the way an engine behind the proxy sees it. The chat and
Anthropic sessions also go through the Responses mapping (`_chat_to_responses`, the history as
a Responses client would keep it, then `to_chat`): its byte-stable folding of a turn's items is
checked on every harness's history, not only Codex's.

Oracle: the session's own traffic rendered untranslated (the native proxy's view, as
`trace_replay.replay` renders it). Wherever the harness only appended there, the translated
prompt of a turn must start with the translated prompt of the turn before (append-only
prefixes): a translation that re-renders history differently from turn to turn (reordered
blocks, regenerated ids, moved thinking) throws the upstream's prefix cache away. Where the
harness edited (OpenClaw's rolling context, OpenCode's prune), the translated prompt must part
from the previous one where the native one does, give or take `SLACK` tokens (a translation may
render a message's framing a few tokens differently, as long as it does so every turn).
Regression (issue 28): translating proxies in front of other engines gave per-turn cache hits
of 14-98% against 82-93% native."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from trace_replay import FILES, TRACES, harness_request, records, tokenizer

from freetoken.chat import anthropic_to_template, openai_to_template
from freetoken.chat.responses_map import input_items, to_chat
from freetoken.proxy.sessions import EditPoint, SessionStore
from freetoken.proxy.translate import anthropic_to_openai_request, openai_to_anthropic_request
from harness_adapters import HarnessRequest, detect_adapter

CODEX = TRACES / "codex" / "codex_responses.jsonl"
SLACK = 8
A2O, O2A = anthropic_to_openai_request, openai_to_anthropic_request


def _responses_to_chat(body: dict) -> dict:
    return to_chat(body, input_items(body))[0]


def _parts(content, kind: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    return [{"type": kind, "text": p.get("text", "")} for p in content or []
            if isinstance(p, dict) and p.get("type") == "text"]


def _chat_to_responses(body: dict) -> dict:
    """A chat body as the Responses request a Responses client keeping the same history would
    send (test-only: the proxy never translates into Responses): each message as its items,
    an assistant turn as reasoning, message and function_call items in the order the model
    emits them, tool results as function_call_output."""
    items: list[dict] = []
    for m in body["messages"]:
        role = m["role"]
        if role == "assistant":
            if m.get("reasoning_content"):
                items.append({"type": "reasoning", "summary": [
                    {"type": "summary_text", "text": m["reasoning_content"]}]})
            text = _parts(m.get("content"), "output_text")
            if any(p["text"] for p in text):
                items.append({"type": "message", "role": "assistant", "content": text})
            for tc in m.get("tool_calls") or []:
                items.append({"type": "function_call", "call_id": tc["id"],
                              "name": tc["function"]["name"],
                              "arguments": tc["function"]["arguments"]})
        elif role == "tool":
            out = m.get("content")
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": out if isinstance(out, str) else _parts(out, "input_text")})
        else:
            items.append({"type": "message", "role": role,
                          "content": _parts(m.get("content"), "input_text")})
    tools = [{"type": "function", "name": t["function"]["name"],
              "description": t["function"].get("description", ""),
              "parameters": t["function"].get("parameters")} for t in body.get("tools") or []]
    out = {"model": body.get("model", ""), "input": items, "tools": tools,
           "stream": bool(body.get("stream"))}
    effort = body.get("reasoning_effort")
    if (body.get("chat_template_kwargs") or {}).get("enable_thinking") is False:
        effort = "none"  # thinking off, in the Responses API's terms
    if effort is not None:
        out["reasoning"] = {"effort": effort}
    return out


# (name, api the body comes in, the steps, api the engine behind sees)
PATHS: list[tuple[str, str, list[Callable[[dict], dict]], str]] = [
    ("anthropic->openai", "anthropic", [A2O], "openai"),
    ("anthropic->openai->anthropic", "anthropic", [A2O, O2A], "anthropic"),
    ("openai->anthropic", "openai", [O2A], "anthropic"),
    ("openai->anthropic->openai", "openai", [O2A, A2O], "openai"),
    ("openai->responses->openai", "openai", [_chat_to_responses, _responses_to_chat], "openai"),
    ("anthropic->openai->responses->openai", "anthropic",
     [A2O, _chat_to_responses, _responses_to_chat], "openai"),
]


_IDS: dict[str, list[int]] = {}  # template input -> ids: a faithful translation renders alike


def _render(body: dict, api: str) -> list[int]:
    ti = (anthropic_to_template if api == "anthropic" else openai_to_template)(body)
    key = json.dumps([ti.messages, ti.tools, ti.enable_thinking], sort_keys=True, default=str)
    if key not in _IDS:
        _IDS[key] = tokenizer().apply(ti.messages, tools=ti.tools,
                                      enable_thinking=ti.enable_thinking).input_ids
    return _IDS[key]


def _check(path: Path, steps: list[Callable[[dict], dict]], api_out: str,
           bodies: list[tuple[str, dict]], native: list[EditPoint]) -> int:
    """Observe each translated prompt per session against the native edit points; returns how
    many later turns (appends and edits) were checked."""
    store, checked = SessionStore(), 0
    for (key, body), nat in zip(bodies, native):
        for step in steps:
            body = step(json.loads(json.dumps(body)))  # a step must not need the input kept
        ep = store.observe_tokens(key, _render(body, api_out), [], [])
        if nat.kind == "new":
            continue
        checked += 1
        assert ep.kind == nat.kind, (path.stem, key, nat, ep)
        if nat.kind == "edit":
            assert ep.position is not None and nat.position is not None
            assert abs(ep.position - nat.position) <= SLACK, (path.stem, key, nat, ep)
    return checked


def _chat_bodies(path: Path) -> tuple[list[tuple[str, dict]], list[EditPoint]]:
    """(session key, normalised body) per generation request, and the native edit points (as
    `trace_replay.replay` finds them: the untranslated body rendered, observed per session)."""
    out, native, store = [], [], SessionStore()
    for rec in records(path):
        if "count_tokens" in rec["path"]:
            continue
        req = harness_request(rec)
        ad = detect_adapter(req)
        body, _ = ad.normalise(req)
        key = ad.session_key(HarnessRequest(req.api, req.path, req.headers, body))
        out.append((key, body))
        native.append(store.observe_tokens(key, _render(body, req.api), [], []))
    return out, native


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_chat_traces_stay_append_only_through_translation(path: Path) -> None:
    bodies, native = _chat_bodies(path)
    api_in = "anthropic" if records(path)[0]["path"].startswith("/v1/messages") else "openai"
    assert len(bodies) == len(native)
    later = sum(e.kind != "new" for e in native)
    assert later, f"{path.stem}: no session has a second turn, nothing to check"
    for name, api, steps, api_out in PATHS:
        if api == api_in:
            assert _check(path, steps, api_out, bodies, native) == later, name


def test_codex_session_stays_append_only_through_chat_and_anthropic() -> None:
    """Codex only appends (tests/chat/test_responses_map.py checks Responses -> chat); the chat
    body it becomes must stay append-only through an Anthropic upstream too."""
    bodies = [("codex", r["body"]) for r in records(CODEX)]
    kinds = [EditPoint("new", "token")] + [EditPoint("append", "token")] * (len(bodies) - 1)
    assert _check(CODEX, [_responses_to_chat], "openai", bodies, kinds) == len(bodies) - 1
    assert _check(CODEX, [_responses_to_chat, O2A], "anthropic", bodies, kinds) == \
        len(bodies) - 1
