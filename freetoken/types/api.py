"""The contract between the server/proxy and the engine.

The server turns an API request into a `GenerateRequest` (token ids + sampling) and awaits
`engine.start(req)`: the engine admits it on its own thread and either raises `AdmissionError`
(anything that can never run; reported to the HTTP layer before a response starts) or returns
the request's event stream. Closing that async iterator early (client disconnect) aborts the
request and frees everything it held. `generate(req)` is the same as one async generator;
`check(req)` runs the admission check on the caller's thread.
"""
from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class AdmissionError(ValueError):
    """A request that can never run (too long, bad sampling values). Maps to HTTP 400."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineBusy(AdmissionError):
    """The engine is rebuilding its buffers (elastic VRAM) and did not admit the request
    within the wait: HTTP 503 with `Retry-After: retry_after` seconds; nothing ran."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message, None, "engine_rebuilding")
        self.retry_after = retry_after


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def validate(self) -> None:
        def bad(msg: str, param: str) -> AdmissionError:
            return AdmissionError(msg, param)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens"
            )
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or t > 100:
            raise bad(f"temperature must be in [0, 100], got {t!r}", "temperature")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0 < p <= 1):
            raise bad(f"top_p must be in (0, 1], got {p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be a non-negative integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and (
            not isinstance(self.seed, int) or self.seed < 0 or self.seed >= 2**63
        ):
            raise bad(f"seed must be a non-negative 64-bit integer, got {self.seed!r}", "seed")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(
                f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", "min_tokens"
            )


@dataclass
class Anchor:
    """A chat-template boundary: `position` is the index of the first token of the block
    (state checkpointed *before* it covers tokens [0, position))."""

    position: int
    # head_end, turn_start, think_start, think_end, tool_call_start, tool_result_start,
    # tool_result_end; system_block (a proxy adapter's head break inside the system text,
    # where another session of the same harness may part from this one: snapshot class head)
    kind: str
    role: str | None = None
    cut_point: bool = False  # predicted by a harness adapter to be an edit point next turn


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling: SamplingParams
    anchors: list[Anchor] = field(default_factory=list)
    session_key: str | None = None
    request_id: str = ""
    parent_key: str | None = None  # a sub-agent's parent session (`freetoken.cache.lineage`)


@dataclass
class EngineEvent:
    """One step of a request's stream. `token_ids` are new tokens since the last event."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (eos/stop id), "length", "abort"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    matched_stop_id: int | None = None


class EngineClient(Protocol):
    """Every member the server (freetoken/server) reads of the engine it fronts
    (tests/structure/test_engine_client.py keeps the list whole). Five are optional for
    engines that lack them (the proxy's upstream engines, test fakes): the server reads them
    with a default — `max_output_tokens` None (no server cap), `vocab_size` None (the
    tokenizer's vocabulary bounds token ids), `model_dir` (only the CLI reads it, for the
    tokenizer and the output-parser family), `resize_experts` and `rebuild_vram` absent
    (POST /ft/v1/control/experts and /ft/v1/control/vram answer 404 not_supported)."""

    model_name: str
    max_context: int
    max_output_tokens: int | None  # the server's ceiling on a reply's tokens (None: none)
    vocab_size: int | None  # the model's vocabulary, often padded past the tokenizer's
    model_dir: Path  # the checkpoint served (the tokenizer and the parser family)

    def check(self, req: GenerateRequest) -> None: ...

    async def start(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]: ...

    def stats(self) -> dict: ...

    async def resize_experts(self, **spec: Any) -> dict:
        """Resize the GPU expert cache (`slots`, `rate` or `mem`); returns the new sizes.
        Raises AdmissionError on a bad spec, engine.core.ResizeError when it cannot allocate."""
        ...

    async def rebuild_vram(self, **spec: Any) -> dict:
        """Rebuild the expert cache, the KV pool and the state pool (`expert_slots`,
        `kv_tokens`, `state_slots`, any of them) at a safe point; returns the new sizes.
        Raises AdmissionError (code `not_supported` when elastic VRAM is off),
        engine.core.ResizeError when it cannot allocate."""
        ...
