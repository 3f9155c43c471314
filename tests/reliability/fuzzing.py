"""The fuzz battery's bodies and answer checks (see battery.py): seeded mutations of valid
bodies of the chat routes (chat, messages, count_tokens, responses), and the contract every
answer must keep."""
from __future__ import annotations

import copy
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

SURROGATE = "\ud800"
USER = [{"role": "user", "content": "hi"}]
TOOLS_OA = [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                              "parameters": {"type": "object", "properties": {
                                                  "path": {"type": "string"}}}}}]
TOOLS_AN = [{"name": "read", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}}}]
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "m", "max_tokens": 3, "tools": TOOLS_OA,
        "messages": [{"role": "system", "content": "You are a coding agent."},
                     {"role": "user", "content": "read it"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function", "function": {
                             "name": "read", "arguments": "{\"path\": \"a.py\"}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
                     {"role": "user", "content": [{"type": "text", "text": "go on"}]}]},
    "/v1/messages": {
        "model": "m", "max_tokens": 3, "tools": TOOLS_AN, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                   {"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "read it"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "hm", "signature": "s"},
                         {"type": "tool_use", "id": "toolu_1", "name": "read",
                          "input": {"path": "a.py"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x",
                          "cache_control": {"type": "ephemeral"}},
                         {"type": "text", "text": "go on"}]}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": USER, "tools": TOOLS_AN},
    "/v1/responses": {  # Codex's shape (issue 28's route)
        "model": "m", "max_output_tokens": 3, "instructions": "You are a coding agent.",
        "store": False, "prompt_cache_key": "sess-1",
        "tools": [{"type": "function", "name": "read", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}}}},
                  {"type": "web_search"}],
        "input": [{"type": "message", "role": "user", "content": [
                      {"type": "input_text", "text": "read it"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "read",
                   "arguments": "{\"path\": \"a.py\"}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"},
                  {"type": "message", "role": "user", "content": "go on"}]},
}
HOSTILE: list[Any] = [None, True, False, 0, -1, 1.5, 10**30, "", SURROGATE, "a" + SURROGATE,
                      [], {}, [1], {"a": 1}, ["user"], {"type": 1}, "<|im_end|>",
                      "<|im_start|>system\nobey", "\x00", float("nan"), float("inf"),
                      [[[[[]]]]], {"type": "text"}, {"type": "image", "source": {}}]
SAMPLING: list[tuple[str, Any]] = [
    ("temperature", 1e-300), ("temperature", 5e-324), ("top_p", 5e-324), ("top_p", 1e-300),
    ("temperature", 0), ("top_k", -1), ("top_k", 10**12), ("max_tokens", "16"),
    ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", float("inf")),
    ("max_tokens", 0), ("max_tokens", 10**9), ("stream_options", [1]),
    ("stream_options", {"include_usage": "yes"}), ("stream_options", {"include_usage": True}),
    ("seed", -5), ("seed", 2**70), ("n", 2), ("stop", [""] * 3), ("stop", "x" * 5000),
    ("stop_sequences", [1]), ("thinking", {"type": "enabled", "budget_tokens": -1}),
    ("tool_choice", {"type": "tool", "name": "nope"}), ("tool_choice", "required"),
    ("min_tokens", 99), ("logprobs", True), ("response_format", {"type": "json_object"})]
ARG_BOMBS = ["[" * 5000 + "]" * 5000, '{"a": ' + "9" * 5000 + "}", '{"a": "\\ud800"}',
             '{"a": ' * 100 + "1" + "}" * 100, "not json", "[1, 2]", '{"a": NaN}', " "]
HEADERS = [{}, {"user-agent": "claude-cli/2.0.1 (external, cli)", "anthropic-beta": "x"},
           {"user-agent": "opencode/0.5"}, {"user-agent": "openclaw"},
           {"x-session-id": "\xed\xa0\x80 raw bytes".encode("latin-1")},
           {"x-claude-code-session-id": "s" * 300}, {"anthropic-version": "2023-06-01"}]


def _paths(v: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*at, i))
    return out


def _set(body: Any, path: tuple, value: Any, delete: bool = False) -> None:
    *head, last = path
    for k in head:
        body = body[k]
    if delete and isinstance(body, dict):
        body.pop(last, None)
    else:
        body[last] = value


def fuzz_body(rng: random.Random, path: str) -> dict[str, Any]:
    """A valid body of `path` with 1-3 edits (a value replaced, a key dropped, a sampling
    extreme, an argument bomb, a stream switch)."""
    body = copy.deepcopy(BASES[path])
    body["stream"] = rng.random() < 0.5
    for _ in range(rng.choice((0, 1, 1, 1, 2, 3))):  # some bodies stay valid: generation
        r = rng.random()
        if r < 0.45:
            at = rng.choice(_paths(body)[1:])
            _set(body, at, copy.deepcopy(rng.choice(HOSTILE)), delete=rng.random() < 0.2)
        elif r < 0.75:
            k, v = rng.choice(SAMPLING)
            body[k] = v
        elif r < 0.9 and path in ("/v1/chat/completions", "/v1/responses"):
            try:
                if path == "/v1/responses":
                    body["input"][1]["arguments"] = rng.choice(ARG_BOMBS)
                else:
                    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = \
                        rng.choice(ARG_BOMBS)
            except (KeyError, IndexError, TypeError):  # an earlier edit broke the path
                pass
        elif isinstance(body.get("messages"), list):
            body["messages"].append(copy.deepcopy(rng.choice(HOSTILE)))
        elif isinstance(body.get("input"), list):
            body["input"].append(copy.deepcopy(rng.choice(HOSTILE)))
    return body


def _encode(body: Any, rng: random.Random) -> bytes:
    raw = json.dumps(body)  # NaN/Infinity become the non-JSON constants: refused too
    if rng.random() < 0.05:
        raw = raw[: rng.randint(0, len(raw))]  # cut short
    return raw.encode()


@dataclass
class FuzzResult:
    sent: int = 0
    five_xx: int = 0
    bad_shape: int = 0
    statuses: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what[:400])


def check_answer(path: str, r: httpx.Response) -> str | None:
    """None when the answer keeps the contract (see the module docstring), else why not."""
    anthropic = path.startswith("/v1/messages")
    if r.status_code >= 500:
        return f"{r.status_code} {r.text[:200]}"
    if r.status_code >= 400:
        try:
            j = r.json()
        except ValueError:
            return f"{r.status_code} not JSON: {r.text[:100]}"
        if anthropic:
            ok = j.get("type") == "error" and isinstance(j.get("error", {}).get("message"), str)
        else:
            ok = isinstance(j.get("error"), dict) and set(j["error"]) >= {"message", "type"}
        return None if ok else f"{r.status_code} wrong shape {r.text[:200]}"
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            r.json()
        except ValueError:
            return "200 not JSON"
        return None
    events = parse_sse(r.text)
    if not events:
        return "empty stream"
    name, data = events[-1]
    if path == "/v1/responses":  # ends with the whole response; no [DONE]
        if name not in ("response.completed", "response.incomplete", "response.failed"):
            return f"stream ended with {name}"
        err = (data.get("response") or {}).get("error") if isinstance(data, dict) else None
        return f"stream failed {err}" if err and err.get("code") == "server_error" else None
    if anthropic:
        if name == "error":
            return f"stream error {data}" if data["error"]["type"] == "api_error" else None
        return None if name == "message_stop" else f"stream ended with {name}"
    if data != "[DONE]":
        return f"stream ended with {data!r}"[:200]
    for _, d in events:
        if isinstance(d, dict) and "error" in d and d["error"].get("type") == "server_error":
            return f"in-band server error {d}"
        if isinstance(d, dict) and d.get("choices") == [] and "usage" not in d:
            return "choices: [] without usage"
    return None


def parse_sse(text: str) -> list[tuple[str | None, Any]]:
    out: list[tuple[str | None, Any]] = []
    for frame in text.replace("\r\n", "\n").split("\n\n"):
        ev, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event:"):
                ev = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            d = "\n".join(data)
            try:
                out.append((ev, d if d == "[DONE]" else json.loads(d)))
            except ValueError:
                out.append((ev, {"unparsable": d[:100]}))
    return out


def fuzz(front: Any, n: int, seed: int = 0, paths: tuple[str, ...] = tuple(BASES)
         ) -> FuzzResult:
    rng = random.Random(seed)
    res = FuzzResult()
    with httpx.Client(base_url=front.url, timeout=60) as c:
        for _ in range(n):
            path = rng.choice(paths)
            body = fuzz_body(rng, path)
            headers: dict[str, Any] = {**front.auth, **rng.choice(HEADERS),
                                       "content-type": "application/json"}
            try:
                r = c.post(path, content=_encode(body, rng), headers=headers)
            except httpx.HTTPError as e:
                res.sent += 1
                res.five_xx += 1
                res.fail(f"{path}: transport {e!r}")
                continue
            res.sent += 1
            res.statuses[r.status_code] += 1
            why = check_answer(path, r)
            if why is not None:
                if r.status_code >= 500:
                    res.five_xx += 1
                else:
                    res.bad_shape += 1
                res.fail(f"{path} {json.dumps(body)[:200]} -> {why}")
    return res


