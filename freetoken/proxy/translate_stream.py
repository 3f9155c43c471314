"""Streaming translation, one upstream SSE event in, zero or more client SSE frames out.

`OpenAIToAnthropic`: chat-completion chunks -> Anthropic events in the order Claude Code and the
SDKs check: `message_start`, per block `content_block_start` / `*_delta`* / `content_block_stop`,
then `message_delta` (stop reason and the full usage, never missing) and `message_stop`. A
thinking block gets its `signature_delta` before it closes; a kind switch (reasoning -> text ->
tool) closes the open block, so a `thinking_delta` never lands in a text block. Each OpenAI tool
call becomes exactly one `tool_use` block, whose start carries `input: {}`; its arguments are
sent as one `input_json_delta` when the call is complete (calls may interleave upstream).

Each translator ends its stream exactly once: `end()` after the end already went out (the
upstream's own `[DONE]` / `message_stop`, then the relay's end of body) or after an upstream
error event returns nothing, and `complete` says whether the upstream reached its end at all (a
stream cut off before it is the relay's to report as an error, never as a clean end of turn).

`AnthropicToOpenAI`: Anthropic events -> chunks (`role` first, `content`, `reasoning_content`,
`tool_calls` with stable indices, one chunk with the finish reason, a usage chunk when the
client asked for `stream_options.include_usage`, then `[DONE]`).
"""
from __future__ import annotations

import json
import time
from typing import Any

from freetoken.proxy.translate import (
    STOP_TO_ANTHROPIC,
    STOP_TO_OPENAI,
    anthropic_usage,
    openai_usage,
    signature,
    usage_from_anthropic,
    usage_from_openai,
)
from freetoken.server.sse import sse


class OpenAIToAnthropic:
    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id, self.model = msg_id, model
        self.started = False
        self.index = -1
        self.kind: str | None = None
        self.thinking: list[str] = []
        self.tools: dict[int, dict[str, Any]] = {}  # openai index -> {id, name, args}
        self.tool_order: list[int] = []
        self.finish: str | None = None
        self.usage: tuple[int, int, int] | None = None
        self.out_chunks = 0
        self.done = False  # the end (or an error) went out: nothing more may follow

    @property
    def complete(self) -> bool:
        """The upstream finished its reply (a finish reason, `[DONE]`, or an error event)."""
        return self.done or self.finish is not None

    def _start(self) -> list[str]:
        if self.started:
            return []
        self.started = True
        msg = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": anthropic_usage(0, 0, 0)}
        return [sse({"type": "message_start", "message": msg}, "message_start"),
                sse({"type": "ping"}, "ping")]

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(self._delta({"type": "signature_delta",
                                    "signature": signature("".join(self.thinking))}))
        self.kind = None
        return out + [sse({"type": "content_block_stop", "index": self.index},
                          "content_block_stop")]

    def _open(self, kind: str, block: dict) -> list[str]:
        out = self._close()
        self.index += 1
        self.kind, self.thinking = kind, []
        return out + [sse({"type": "content_block_start", "index": self.index,
                           "content_block": block}, "content_block_start")]

    def _delta(self, d: dict) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": d},
                   "content_block_delta")

    def _flush_tools(self) -> list[str]:
        out: list[str] = []
        for k in self.tool_order:
            t = self.tools[k]
            out += self._open("tool_use", {"type": "tool_use", "id": t["id"], "name": t["name"],
                                           "input": {}})
            args = "".join(t["args"]) or "{}"
            out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
            out += self._close()
        self.tools.clear()
        self.tool_order.clear()
        return out

    def push(self, data: Any) -> list[str]:
        """One decoded `data:` payload (a chunk dict, or '[DONE]')."""
        if self.done:
            return []
        if data == "[DONE]":
            return self.end()
        if not isinstance(data, dict):
            return []
        if "error" in data:
            err = data["error"] if isinstance(data["error"], dict) else {"message": data["error"]}
            self.done = True
            return [sse({"type": "error", "error": {"type": "api_error",
                                                   "message": str(err.get("message"))}}, "error")]
        out = self._start()
        if data.get("usage"):
            self.usage = usage_from_openai(data["usage"], data.get("timings"))
        for ch in data.get("choices") or []:
            d = ch.get("delta") or {}
            r = d.get("reasoning_content") or d.get("reasoning")
            if r:
                if self.kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "",
                                                   "signature": ""})
                self.thinking.append(r)
                out.append(self._delta({"type": "thinking_delta", "thinking": r}))
                self.out_chunks += 1
            if d.get("content"):
                if self.kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
                self.out_chunks += 1
            for tc in d.get("tool_calls") or []:
                k = int(tc.get("index", len(self.tool_order)))
                if k not in self.tools:
                    out += self._close()
                    self.tools[k] = {"id": tc.get("id") or f"toolu_{self.msg_id}_{k}",
                                     "name": "", "args": []}
                    self.tool_order.append(k)
                fn = tc.get("function") or {}
                if fn.get("name"):
                    self.tools[k]["name"] = fn["name"]
                if fn.get("arguments"):
                    self.tools[k]["args"].append(fn["arguments"])
                self.out_chunks += 1
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
        return out

    def end(self) -> list[str]:
        """Close everything, once (also when the upstream ended after its finish reason
        without [DONE])."""
        if self.done:
            return []
        self.done = True
        out = self._start() + self._close() + self._flush_tools()
        prompt, cached, output = self.usage or (0, 0, self.out_chunks)
        stop = STOP_TO_ANTHROPIC.get(self.finish or "stop", "end_turn")
        out.append(sse({"type": "message_delta", "delta": {"stop_reason": stop,
                                                           "stop_sequence": None},
                        "usage": anthropic_usage(prompt, cached, output)}, "message_delta"))
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return out


class AnthropicToOpenAI:
    def __init__(self, chunk_id: str, model: str, include_usage: bool) -> None:
        self.id, self.model, self.include_usage = chunk_id, model, include_usage
        self.created = int(time.time())
        self.block_tool: dict[int, int] = {}  # anthropic block index -> openai tool index
        self.finish: str | None = None
        self.prompt = self.cached = self.output = 0
        self.done = False

    @property
    def complete(self) -> bool:
        """The upstream finished its reply (`message_delta` with a stop reason,
        `message_stop`, or an error event)."""
        return self.done or self.finish is not None

    def _chunk(self, delta: dict, finish: str | None = None) -> str:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [{"index": 0, "delta": delta,
                                                      "finish_reason": finish}]})

    def push(self, event: str | None, data: Any) -> list[str]:
        if self.done or not isinstance(data, dict):
            return []
        kind = data.get("type") or event
        if kind == "message_start":
            self.prompt, self.cached, _ = usage_from_anthropic(
                (data.get("message") or {}).get("usage"))
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            b = data.get("content_block") or {}
            if b.get("type") == "tool_use":
                k = len(self.block_tool)
                self.block_tool[int(data.get("index", 0))] = k
                return [self._chunk({"tool_calls": [{"index": k, "id": b.get("id"),
                                                     "type": "function", "function": {
                                                         "name": b.get("name"),
                                                         "arguments": ""}}]})]
            return []
        if kind == "content_block_delta":
            d = data.get("delta") or {}
            t = d.get("type")
            if t == "text_delta":
                return [self._chunk({"content": d.get("text", "")})]
            if t == "thinking_delta":
                return [self._chunk({"reasoning_content": d.get("thinking", "")})]
            if t == "input_json_delta":
                k = self.block_tool.get(int(data.get("index", 0)), 0)
                return [self._chunk({"tool_calls": [{"index": k, "function": {
                    "arguments": d.get("partial_json", "")}}]})]
            return []
        if kind == "message_delta":
            self.finish = STOP_TO_OPENAI.get((data.get("delta") or {}).get("stop_reason")
                                             or "end_turn", "stop")
            u = data.get("usage") or {}
            if "input_tokens" in u:
                self.prompt, self.cached, _ = usage_from_anthropic(u)
            self.output = int(u.get("output_tokens") or self.output)
            return []
        if kind == "message_stop":
            return self.end()
        if kind == "error":
            err = data.get("error") or {}
            self.done = True
            return [sse({"error": {"message": err.get("message"), "type": err.get("type"),
                                   "param": None, "code": None}}), "data: [DONE]\n\n"]
        return []

    def end(self) -> list[str]:
        if self.done:
            return []
        self.done = True
        out = [self._chunk({}, self.finish or "stop")]
        if self.include_usage:
            out.append(sse({"id": self.id, "object": "chat.completion.chunk",
                            "created": self.created, "model": self.model, "choices": [],
                            "usage": openai_usage(self.prompt, self.cached, self.output)}))
        return out + ["data: [DONE]\n\n"]


def json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
