"""From a tokenized prompt to a stream of parsed output events, shared by every route.

`plan()` turns prompt ids + API sampling fields (already range-checked by
`validation.common_params`) into a `GenerateRequest`, sizing `max_tokens` to the context room
(O(1); a prompt that leaves no room is refused here, naming the route's own prompt field).
`admit()` has the engine admit it on its own thread (`EngineCore.check`, the one admission check
of a request: sampling values, context, vocabulary, O(prompt)) and maps a refusal to
APIError(400) while the HTTP response can still carry it. `drive()` iterates the admitted
stream, feeds the token ids through an output parser (reasoning / text / tool calls), matches
stop strings in the decoded text channel, and yields `Started`, parser events and one final
`Finished`. Closing the `drive()` generator early closes the stream, which aborts the request.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from freetoken.log import get_logger, kv
from freetoken.server.errors import APIError
from freetoken.server.stops import StopMatcher
from freetoken.server.validation import CommonParams
from freetoken.types.api import (
    AdmissionError,
    Anchor,
    EngineClient,
    EngineEvent,
    GenerateRequest,
    SamplingParams,
)

log = get_logger("server")

CLAMP_HEADER = "x-ft-max-tokens-clamped"
OUTPUT_CAP_HEADER = "x-ft-output-cap"  # the server's own cap ended (or would end) the reply
DEMO_OUTPUT_CAP = 256  # `ft serve --model demo|demo-random`: the demos may never end a reply
DEMO_MODELS = ("demo", "demo-random")
REQUESTED_HEADER = "x-ft-max-tokens-requested"
SESSION_HEADERS = ("x-claude-code-session-id", "x-session-id", "x-session-affinity")
AGENT_HEADER = "x-claude-code-agent-id"  # Claude Code: sent by sub-agents, beside the parent's id
PARENT_HEADER = "x-parent-session-id"  # OpenCode: a sub-agent session names its parent's id
CODEX_META = "x-codex-turn-metadata"  # Codex: JSON, `parent_thread_id` for a spawned thread


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def session_key_from(headers: Any) -> str | None:
    """The harness session header, in priority order (Claude Code, then OpenCode's); a Claude
    Code sub-agent (its agent id beside the parent's session id) is its own session,
    `SESSION/AGENT` (#23: the cache's lineage, `freetoken.cache.lineage`)."""
    for h in SESSION_HEADERS:
        v = headers.get(h)
        if v:
            agent = headers.get(AGENT_HEADER) if h == SESSION_HEADERS[0] else None
            return (f"{str(v)[:128]}/{str(agent)[:64]}" if agent else str(v))[:256]
    return None


def parent_key_from(headers: Any) -> str | None:
    """The parent session a sub-agent's harness names, as that session's `session_key_from`
    key: Claude Code's session id beside an agent id, OpenCode's `x-parent-session-id`,
    Codex's turn metadata `parent_thread_id` (its threads are keyed by `prompt_cache_key`, the
    thread id); None for a top-level session or where no header says (the cache then infers
    the parent from prefix structure)."""
    sid, agent = headers.get(SESSION_HEADERS[0]), headers.get(AGENT_HEADER)
    if sid and agent:
        return str(sid)[:128]
    if headers.get(PARENT_HEADER):
        return str(headers[PARENT_HEADER])[:256]
    try:
        meta = json.loads(headers.get(CODEX_META) or "null")
    except ValueError:
        return None
    parent = meta.get("parent_thread_id") if isinstance(meta, dict) else None
    return str(parent)[:256] if parent else None


def default_output_cap(model: str | None, given: int | None) -> int | None:
    """`ft serve --max-output-tokens`: N as given (0 = no cap); unset, DEMO_OUTPUT_CAP for the
    demo models (`demo`, and `demo-random`, whose random weights never end a reply) and no cap
    for a real checkpoint (the context room bounds it)."""
    if given is not None:
        return given if given > 0 else None
    return DEMO_OUTPUT_CAP if (model or "demo") in DEMO_MODELS else None


@dataclass
class Plan:
    """`output_cap`: the server's cap when it, not the client's limit, bounds the reply; a
    reply stopped there is a normal end of turn (the client's own limit was not reached, and
    Claude Code turns a `max_tokens` stop into an error)."""

    req: GenerateRequest
    prompt_len: int
    headers: dict[str, str] = field(default_factory=dict)
    output_cap: int | None = None


def plan(engine: EngineClient, input_ids: list[int], anchors: list[Anchor], p: CommonParams,
         eos_ids: list[int], session_key: str | None, request_id: str,
         prompt_param: str = "messages", parent_key: str | None = None) -> Plan:
    """The request, or APIError(400). `max_tokens` is a ceiling: clamped to the room left in
    the context and to the server's output cap if it has one (reported in CLAMP_HEADER);
    absent, it is that room."""
    n = len(input_ids)
    if n == 0:
        raise APIError.bad("the prompt is empty", prompt_param)
    room = engine.max_context - n
    if room <= 0:
        raise APIError.bad(
            f"the prompt is {n} tokens; this server's context is {engine.max_context} tokens, "
            "which leaves no room to generate", prompt_param, "context_length_exceeded")
    headers: dict[str, str] = {}
    cap = getattr(engine, "max_output_tokens", None)  # `ft serve --max-output-tokens`
    capped_by_server = bool(cap) and cap < room and (p.max_tokens is None or cap < p.max_tokens)
    if cap:
        room = min(room, cap)
    max_tokens = room if p.max_tokens is None else min(p.max_tokens, room)
    if capped_by_server:
        headers[OUTPUT_CAP_HEADER] = str(max_tokens)
    if p.max_tokens is not None and max_tokens < p.max_tokens:
        headers[CLAMP_HEADER] = str(max_tokens)
        headers[REQUESTED_HEADER] = str(p.max_tokens)
        log.debug(kv("clamp_max_tokens", request=request_id, requested=p.max_tokens,
                     effective=max_tokens, prompt=n))
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        seed=p.seed, stop_token_ids=[] if p.ignore_eos else list(eos_ids),
        ignore_eos=p.ignore_eos, min_tokens=min(p.min_tokens, max_tokens))
    return Plan(GenerateRequest(list(input_ids), sampling, list(anchors), session_key,
                                request_id, parent_key), n, headers,
                max_tokens if capped_by_server else None)


async def admit(engine: EngineClient, pl: Plan) -> AsyncIterator[EngineEvent]:
    """The admitted request's event stream, or APIError(400) with the engine's reason."""
    try:
        return await engine.start(pl.req)
    except AdmissionError as e:
        raise APIError.from_admission(e) from None


class Parser(Protocol):
    def push(self, ids: list[int]) -> list[Any]: ...

    def finish(self) -> list[Any]: ...


@dataclass
class Started:
    """The engine's first event arrived: prompt processed (possibly partly from cache)."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Finished:
    """`reason`: 'stop' (end of turn / stop token), 'length', or 'stop_sequence' (then
    `stop_sequence` is the matched string)."""

    reason: str
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


async def drive(gen: AsyncIterator[EngineEvent], pl: Plan, parser: Parser, stops: list[str],
                text_type: type, make_text: Any) -> AsyncIterator[Any]:
    """Over `gen` (from `admit`): yield Started, parser events (text events of type `text_type`
    cut at stop strings, rebuilt with `make_text(str)`), then Finished. Raises APIError(503) if
    the engine aborts."""
    matcher = StopMatcher(stops)
    prompt_tokens, cached, out_tokens = pl.prompt_len, 0, 0
    started = False
    try:
        async for ev in gen:
            if not started:
                started = True
                prompt_tokens = ev.prompt_tokens or pl.prompt_len
                cached = ev.cached_tokens
                yield Started(prompt_tokens, cached)
            ids = list(ev.token_ids)
            out_tokens += len(ids)
            if (
                ev.finished
                and ev.matched_stop_id is not None
                and ids
                and ids[-1] == ev.matched_stop_id
            ):
                ids = ids[:-1]  # the end-of-turn token is counted, never shown
            events = parser.push(ids) if ids else []
            if ev.finished:
                events += parser.finish()
            for out in events:
                if not isinstance(out, text_type):
                    flushed = matcher.flush()
                    if flushed:
                        yield make_text(flushed)
                    yield out
                    continue
                text, hit = matcher.push(out.text)
                if text:
                    yield make_text(text)
                if hit is not None:
                    log.debug(kv("stop_string", request=pl.req.request_id, stop=repr(hit)))
                    yield Finished("stop_sequence", hit, prompt_tokens, cached, out_tokens)
                    return
            if ev.finished:
                if ev.finish_reason == "abort":
                    raise APIError(503, "the engine aborted this request", None, "engine_abort")
                rest = matcher.flush()
                if rest:
                    yield make_text(rest)
                reason = "length" if ev.finish_reason == "length" else "stop"
                if reason == "length" and pl.output_cap is not None:
                    log.info(kv("output_cap", request=pl.req.request_id, cap=pl.output_cap))
                    reason = "stop"  # the server's cap, not the client's limit: end of turn
                yield Finished(reason, None, prompt_tokens, cached, out_tokens)
                return
        raise APIError(500, "the engine stream ended without a finish event", None, "engine_error")
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()  # type: ignore[attr-defined]
