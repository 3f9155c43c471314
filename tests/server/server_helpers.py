"""Shared by the server tests: a scripted fake engine behind a real uvicorn server, with the
real Qwen3 tokenizer.

`FakeEngine` implements `EngineClient`: each request emits the token ids of its script (text
encoded with the Qwen3 tokenizer, then `<|im_end|>`), a few ids per event, and honours
max_tokens ("length"), ignore_eos and stop_token_ids. `cached_tokens` is the longest common
prefix with any earlier prompt (a plain model of a prefix cache). Closing a generator before it
finished is recorded in `aborted`.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import uvicorn

from freetoken.chat import ChatTokenizer
from freetoken.types.api import AdmissionError, EngineEvent, GenerateRequest

API_KEY = "test-key"
MAX_CONTEXT = 40960


@dataclass
class FakeEngine:
    tok: ChatTokenizer
    model_name: str = "fake-qwen3"
    max_context: int = MAX_CONTEXT
    model_dir: str = ""
    script: Callable[[GenerateRequest], str] = lambda req: "Hello from the fake engine."
    per_event: int = 3
    delay_s: float = 0.0
    first_delay_s: float = 0.0
    abort_after: int | None = None  # events before the engine itself aborts the request
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.script = lambda req: "Hello from the fake engine."
        self.per_event, self.delay_s, self.first_delay_s = 3, 0.0, 0.0
        self.abort_after = None
        self.requests.clear()
        self.aborted.clear()
        self.finished.clear()

    def check(self, req: GenerateRequest) -> None:
        # the real engine's rule (EngineCore.check), so the server's error path is exercised
        if len(req.input_ids) + 1 > self.max_context:
            raise AdmissionError(f"the prompt has {len(req.input_ids)} tokens; the context holds "
                                 f"{self.max_context}", "messages", "context_length_exceeded")

    async def start(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        self.check(req)  # as the real engine: the admission check, then the stream
        return self.generate(req)

    def stats(self) -> dict:
        return {"requests": len(self.requests), "aborted": len(self.aborted)}

    def _cached(self, ids: list[int]) -> int:
        best = 0
        for r in self.requests[:-1]:
            n = 0
            for a, b in zip(r.input_ids, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1)

    def generate(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        self.requests.append(req)
        return self._gen(req)

    async def _gen(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        sp = req.sampling
        eos = self.tok.encode("<|im_end|>")[0]
        out = self.tok.encode(self.script(req)) + [eos]
        if sp.ignore_eos:
            out = [t for t in out if t != eos] * (sp.max_tokens // max(len(out), 1) + 1)
        cached = self._cached(req.input_ids)
        done = False
        try:
            await asyncio.sleep(self.first_delay_s)
            emitted = 0
            for step in range(1 << 30):
                if step == self.abort_after:
                    done = True
                    yield EngineEvent([], True, "abort", len(req.input_ids), cached)
                    return
                n = min(self.per_event, len(out) - emitted, sp.max_tokens - emitted)
                ids = out[emitted:emitted + n]
                emitted += n
                stop = next((t for t in ids if t in sp.stop_token_ids), None)
                if stop is not None:
                    ids = ids[: ids.index(stop) + 1]
                reason = ("stop" if stop is not None else
                          "length" if emitted >= sp.max_tokens or emitted >= len(out) else None)
                done = reason is not None
                yield EngineEvent(ids, done, reason, len(req.input_ids), cached, stop)
                if done:
                    self.finished.append(req.request_id)
                    return
                await asyncio.sleep(self.delay_s)
        finally:
            if not done:
                self.aborted.append(req.request_id)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, app: object) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                             lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 10:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


def parse_sse(text: str) -> list[tuple[str | None, object]]:
    """(event name, decoded data) per frame; comment-only frames come back as ('#comment', line)."""
    out = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        ev, data = None, []
        for line in frame.split("\n"):
            if line.startswith(":"):
                out.append(("#comment", line))
            elif line.startswith("event: "):
                ev = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            d = "\n".join(data)
            out.append((ev, d if d == "[DONE]" else json.loads(d)))
    return out
