"""Recorded harness traces as the engine receives them, for `ft bench anchors`.

One `.jsonl` file is one trace (`harness_traces/README.md`: one HTTP request a line). Each
generation request is what the agent proxy hands the engine: normalised by its harness adapter
(the proxy's default steps: a Claude Code resume that drops the model's `[1m]` suffix renders
as the session did), then rendered through the real API mapping and chat template; OpenAI
Responses bodies (Codex: `input` items, not `messages`) are mapped to the chat shape first
(`responses_to_chat`). Its cache session and parent are what the agent proxy sends: the
claiming harness adapter's `session_key` and `parent_key` (sub-agents apart from their
parent), qualified by the trace name so that traces replayed side by side never share one.

Nothing is dropped in silence: a line that is not JSON, a generation request whose body the
mapping or the template rejects, and a trace that yields no request all raise `TraceError`
naming the file and line. Only `count_tokens` calls are skipped (no generation).

Generated tokens (`attribute_replies`): a request's reply is what the next request *of its
session* that extends its prompt appended up to the first `<|im_end|>` (the harness sends the
model's output back); sub-agent requests in between never count as the reply. A request no
later request extends gets 32 fresh tokens nothing else contains.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from freetoken.bench.anchor_sim import SimRequest
from freetoken.chat import ChatTokenizer, anthropic_to_template, openai_to_template
from freetoken.chat.errors import ChatInputError

Predictor = Callable[[Any, list, list], list[int]]


class TraceError(ValueError):
    """A trace the bench cannot replay faithfully; the message names the record."""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict)
                       and p.get("type") in ("input_text", "output_text", "text",
                                             "summary_text"))
    return ""


def _tool(t: dict) -> list[dict]:
    if t.get("type") == "function":
        return [{"type": "function", "function": {
            "name": t.get("name", ""), "description": t.get("description", ""),
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}]
    if t.get("type") == "namespace":  # a group of functions (Codex's sub-agent tools)
        return [x for sub in t.get("tools") or [] if isinstance(sub, dict) for x in _tool(sub)]
    return []  # hosted tools (web_search) render nothing a local model could call


def responses_to_chat(body: dict) -> dict:
    """An OpenAI Responses request body as a chat-completions body: `instructions` and the
    leading developer/system messages become one system message; reasoning items go to the
    next assistant message's `reasoning_content`; `function_call` items join that assistant
    message's `tool_calls`; `function_call_output` items become tool messages."""
    inp = body.get("input")
    if isinstance(inp, str):
        inp = [{"type": "message", "role": "user", "content": inp}]
    if not isinstance(inp, list):
        raise ChatInputError("'input' must be a string or a list of items", "input")
    system = [body["instructions"]] if isinstance(body.get("instructions"), str) else []
    msgs: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        if not (msgs and msgs[-1]["role"] == "assistant" and not reasoning):
            msgs.append({"role": "assistant", "content": ""})
        m = msgs[-1]
        if reasoning:
            m["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return m

    for it in inp:
        if not isinstance(it, dict):
            raise ChatInputError("every 'input' item must be an object", "input")
        kind, role = it.get("type", "message"), it.get("role")
        if kind == "message" and role in ("developer", "system") and not msgs:
            system.append(_text(it.get("content")))
        elif kind == "message" and role == "assistant":
            m = assistant()
            m["content"] = (m["content"] or "") + _text(it.get("content"))
        elif kind == "message":
            msgs.append({"role": "system" if role == "developer" else role or "user",
                         "content": _text(it.get("content"))})
        elif kind == "reasoning":
            reasoning.append(_text(it.get("summary")) or _text(it.get("content")))
        elif kind == "function_call":
            m = assistant()
            m.setdefault("tool_calls", []).append({
                "id": it.get("call_id", ""), "type": "function",
                "function": {"name": it.get("name", ""), "arguments": it.get("arguments", "")}})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id", ""),
                         "content": out if isinstance(out, str) else _text(out)})
    out: dict[str, Any] = {"model": body.get("model", ""),
                           "messages": ([{"role": "system", "content": "\n\n".join(system)}]
                                        if system else []) + msgs}
    tools = [x for t in body.get("tools") or [] if isinstance(t, dict) for x in _tool(t)]
    if tools:
        out["tools"] = tools
    return out


def _render(tok: ChatTokenizer, path: str, body: dict[str, Any], headers: dict[str, str],
            trace: str, predictor: Predictor | None, heads: Any = None) -> SimRequest:
    """One request as the engine receives it through the agent proxy: the claiming adapter's
    normalisation (`HarnessAdapter.normalise`, the proxy's default steps and its folding of
    mid-conversation system messages where the template refuses them), then the API mapping
    and the chat template; session key, head and user breaks and predicted cuts from the
    normalised body, the parent key from the headers (as `proxy.app`). `heads` (a
    `proxy.heads.HeadBreaks`): add the `system_block` anchors the native proxy adds at the
    adapter's head and user breaks."""
    api = "anthropic" if path.startswith("/v1/messages") else "openai"
    try:
        from harness_adapters import HarnessRequest, detect_adapter
        from harness_adapters.base import first_user_text, system_text
    except ImportError:  # the engine alone: one session per trace, no adapters' anchors
        p = _apply(tok, api, body)
        return SimRequest(trace, p.input_ids, p.anchors, trace=trace)
    hdrs = {k.lower(): v for k, v in headers.items()}
    received = HarnessRequest(api, path, hdrs, body)
    adapter = detect_adapter(received)
    norm = adapter.normalise(received, fold_system=_folds(tok))[0]
    req = HarnessRequest(api, path, hdrs, norm)
    ti = _mapping(api)(norm)
    p = tok.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking)
    anchors = p.anchors
    session = f"{trace}/{adapter.session_key(req)}"
    pk = adapter.parent_key(received)
    parent = f"{trace}/{pk}" if pk else None
    cuts = predictor(req, p.anchors, ti.messages) if predictor is not None else None
    if heads is not None:
        anchors = heads.anchors(anchors, system_text(norm), adapter.head_breaks(norm),
                                p.input_ids)
        anchors = heads.anchors(anchors, first_user_text(norm), adapter.user_breaks(norm),
                                p.input_ids)
    return SimRequest(session, p.input_ids, anchors, cuts=cuts, parent=parent, trace=trace)


def _mapping(api: str) -> Callable[[dict], Any]:
    return anthropic_to_template if api == "anthropic" else openai_to_template


def _apply(tok: ChatTokenizer, api: str, body: dict[str, Any]) -> Any:
    ti = _mapping(api)(body)
    return tok.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking)


_FOLDS: dict[int, bool] = {}


def _folds(tok: ChatTokenizer) -> bool:
    """The proxy's `fold_system=auto` for this tokenizer (`proxy.state`), asked once."""
    if id(tok) not in _FOLDS:
        from freetoken.proxy.state import template_rejects_mid_system

        _FOLDS[id(tok)] = template_rejects_mid_system(tok)
    return _FOLDS[id(tok)]


def load_trace(tok: ChatTokenizer, path: Path, name: str | None = None,
               predictor: Predictor | None = None, heads: Any = None,
               edit: Callable[[dict], dict] | None = None) -> list[SimRequest]:
    """A recorded trace's generation requests rendered (`_render`), in recorded order; `edit`
    rewrites each body first (a held-out-style variant: another directory, a resume). Raises
    `TraceError` naming the record it cannot read (see the module docstring)."""
    name = name or path.stem
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace: {e}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise TraceError(f"{where}: not a JSON record ({e})") from None
        rpath = str(rec.get("path", "")) if isinstance(rec, dict) else ""
        if "count_tokens" in rpath:
            continue
        body = rec.get("body") if isinstance(rec, dict) else None
        if not isinstance(body, dict) or not ("messages" in body or "input" in body):
            raise TraceError(f"{where}: no request body with 'messages' or 'input' "
                             f"(path {rpath!r})")
        try:
            if "input" in body and "messages" not in body:
                body, rpath = responses_to_chat(body), "/v1/chat/completions"
            if edit is not None:
                body = edit(body)
            out.append(_render(tok, rpath, body, rec.get("headers") or {}, name, predictor,
                               heads))
        except ChatInputError as e:
            raise TraceError(f"{where}: the request does not render: {e}") from None
    if not out:
        raise TraceError(f"{path}: no generation request in the trace")
    return out


def attribute_replies(reqs: list[SimRequest], im_end: int) -> None:
    """Fill `gen` of every request (see the module docstring), whatever the interleaving."""
    fresh = 10**9
    pending: dict[str, list[SimRequest]] = {}  # session -> requests without a reply yet
    for r in reqs:
        waiting = pending.setdefault(r.session, [])
        for prev in list(waiting):
            n = len(prev.ids)
            if len(r.ids) > n and r.ids[:n] == prev.ids:
                tail = r.ids[n:]
                prev.gen = tail[: tail.index(im_end)] if im_end in tail else tail
                waiting.remove(prev)
        waiting.append(r)
    for r in reqs:
        if not r.gen:
            r.gen = list(range(fresh, fresh + 32))
            fresh += 32


def interleave(streams: list[list[SimRequest]]) -> list[SimRequest]:
    """Concurrent sessions: the traces' requests round-robin, each trace in its order."""
    out, i = [], 0
    while any(i < len(s) for s in streams):
        out += [s[i] for s in streams if i < len(s)]
        i += 1
    return out
