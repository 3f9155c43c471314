"""A chat-completions SSE stream re-emitted as Responses API events, in the API's order:

`response.created`, `response.in_progress`, then per output item `response.output_item.added`,
its content (a message: `response.content_part.added`, `response.output_text.delta`*,
`response.output_text.done`, `response.content_part.done`; a function call:
`response.function_call_arguments.delta`*, `response.function_call_arguments.done`; reasoning:
`response.reasoning_summary_part.added`, `response.reasoning_summary_text.delta`*,
`response.reasoning_summary_text.done`, `response.reasoning_summary_part.done`),
`response.output_item.done`; last `response.completed` (or `response.incomplete` when the
reply hit `max_output_tokens`, `response.failed` on an error) with the whole response. Every
event carries `sequence_number` (0, 1, ...); there is no `[DONE]`. SSE comments (keep-alives
while the engine prefills) pass through as comments.
"""
from __future__ import annotations

import json
from typing import Any

from freetoken.chat.responses_map import (
    ToolNames,
    call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
    usage_from_chat,
)
from freetoken.server.sse import sse


class ResponsesEvents:
    """Feed chat chunks (`feed`), then `finish`; each returns SSE frames to send."""

    def __init__(self, rid: str, body: dict, names: ToolNames) -> None:
        self.rid, self.body, self.names = rid, body, names
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict] = {}  # chat tool-call index -> open item state
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.timings: dict | None = None  # llama.cpp's counters, beside (or instead of) usage
        self.created = 0

    def _ev(self, kind: str, **fields: Any) -> str:
        frame = sse({"type": kind, "sequence_number": self.seq, **fields}, kind)
        self.seq += 1
        return frame

    def start(self) -> list[str]:
        r = response_object(self.rid, self.body, [], None, "in_progress")
        self.created = r["created_at"]
        return [self._ev("response.created", response=r),
                self._ev("response.in_progress", response=r)]

    def _close(self) -> list[str]:
        o = self.open
        if o is None:
            return []
        self.open = None
        i, kind, text = o["index"], o["kind"], "".join(o["parts"])
        if kind == "message":
            item = message_item(text, o["id"])
            part = item["content"][0]
            out = [self._ev("response.output_text.done", item_id=o["id"], output_index=i,
                            content_index=0, text=text, logprobs=[]),
                   self._ev("response.content_part.done", item_id=o["id"], output_index=i,
                            content_index=0, part=part)]
        elif kind == "reasoning":
            item = reasoning_item(text, o["id"])
            out = [self._ev("response.reasoning_summary_text.done", item_id=o["id"],
                            output_index=i, summary_index=0, text=text),
                   self._ev("response.reasoning_summary_part.done", item_id=o["id"],
                            output_index=i, summary_index=0, part=item["summary"][0])]
        else:
            item = call_item(o["call_id"], o["name"], text, self.names, o["id"])
            done = {"arguments": text} if item["type"] == "function_call" else {
                "input": item["input"]}
            ev = ("response.function_call_arguments.done" if item["type"] == "function_call"
                  else "response.custom_tool_call_input.done")
            out = [self._ev(ev, item_id=o["id"], output_index=i, **done)]
        self.output.append(item)
        return out + [self._ev("response.output_item.done", output_index=i, item=item)]

    def _open(self, kind: str, **extra: Any) -> list[str]:
        out = self._close()
        i = len(self.output)
        if kind == "message":
            iid = new_id("msg_")
            item: dict = {"type": "message", "id": iid, "status": "in_progress",
                          "role": "assistant", "content": []}
            out.append(self._ev("response.output_item.added", output_index=i, item=item))
            out.append(self._ev("response.content_part.added", item_id=iid, output_index=i,
                                content_index=0, part={"type": "output_text", "text": "",
                                                       "annotations": []}))
        elif kind == "reasoning":
            iid = new_id("rs_")
            out.append(self._ev("response.output_item.added", output_index=i, item={
                "type": "reasoning", "id": iid, "summary": []}))
            out.append(self._ev("response.reasoning_summary_part.added", item_id=iid,
                                output_index=i, summary_index=0,
                                part={"type": "summary_text", "text": ""}))
        else:
            item = call_item(extra["call_id"], extra["name"], "", self.names,
                             status="in_progress")
            if item["type"] == "custom_tool_call":
                item["input"] = ""
            iid = item["id"]
            out.append(self._ev("response.output_item.added", output_index=i, item=item))
        self.open = {"index": i, "kind": kind, "id": iid, "parts": [], **extra}
        return out

    def _delta(self, text: str) -> list[str]:
        o = self.open
        assert o is not None
        o["parts"].append(text)
        i, iid = o["index"], o["id"]
        if o["kind"] == "message":
            return [self._ev("response.output_text.delta", item_id=iid, output_index=i,
                             content_index=0, delta=text, logprobs=[])]
        if o["kind"] == "reasoning":
            return [self._ev("response.reasoning_summary_text.delta", item_id=iid,
                             output_index=i, summary_index=0, delta=text)]
        if self.names.kind(o["name"])[0] == "custom":
            return []  # custom input is JSON-wrapped in the chat call: sent whole at done
        return [self._ev("response.function_call_arguments.delta", item_id=iid,
                         output_index=i, delta=text)]

    def feed(self, chunk: dict) -> list[str]:
        out: list[str] = []
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        for ch in chunk.get("choices") or []:
            d = ch.get("delta") or {}
            if d.get("reasoning_content"):
                if self.open is None or self.open["kind"] != "reasoning":
                    out += self._open("reasoning")
                out += self._delta(d["reasoning_content"])
            if d.get("content"):
                if self.open is None or self.open["kind"] != "message":
                    out += self._open("message")
                out += self._delta(d["content"])
            for tc in d.get("tool_calls") or []:
                idx = tc.get("index", 0)
                fn = tc.get("function") or {}
                if idx not in self.calls:
                    self.calls[idx] = {}
                    out += self._open("call", call_id=tc.get("id") or new_id("call_"),
                                      name=fn.get("name") or "")
                if fn.get("arguments"):
                    out += self._delta(fn["arguments"])
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]
        return out

    def response(self) -> dict:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        return response_object(self.rid, self.body, self.output,
                               usage_from_chat(self.usage, self.timings), status, self.created)

    def finish(self) -> list[str]:
        out = self._close()
        r = self.response()
        kind = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
        return out + [self._ev(kind, response=r)]

    def failed(self, message: str, code: str = "server_error") -> list[str]:
        out = self._close()
        r = response_object(self.rid, self.body, self.output,
                            usage_from_chat(self.usage, self.timings), "failed", self.created)
        r["error"] = {"code": code, "message": message}
        return out + [self._ev("response.failed", response=r)]


def chat_frames(text: str) -> list[tuple[str, Any]]:
    """SSE text from a chat stream -> [("comment", line) | ("data", parsed JSON | "[DONE]")]."""
    out: list[tuple[str, Any]] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = []
        for line in block.split("\n"):
            if line.startswith(":"):
                out.append(("comment", line))
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            payload = "\n".join(data)
            try:
                out.append(("data", payload if payload == "[DONE]" else json.loads(payload)))
            except ValueError:
                continue
    return out
