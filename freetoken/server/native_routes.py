"""Native and control routes: /health, /v1/stats, /ft/v1/generate, /ft/v1/control/experts,
/ft/v1/control/vram (elastic VRAM: expert cache, KV pool and state pool rebuilt together,
docs/server.md).

/ft/v1/control/experts re-budgets the GPU expert cache of a running server: `{"slots": N}`,
`{"rate": 0.37}` or `{"mem": bytes}`, applied by the engine thread between two steps, all or
nothing (a failed allocation answers 409 and the previous cache keeps serving).

/ft/v1/generate is what the agent proxy sends our engine: token ids already rendered, anchors
with predicted cut points, a session key. Body:
`{"input_ids": [int], "sampling": {SamplingParams fields}, "anchors": [{"position", "kind",
"role", "cut_point"}], "session_key": str, "parent_key": str}` (parent_key: a sub-agent's
parent session, for snapshot eviction). The answer is an SSE stream of
`{"token_ids", "finished", "finish_reason", "prompt_tokens", "cached_tokens", "matched_stop_id"}`
events, the last with `finished: true`. `max_tokens` is clamped like everywhere else; absent
`stop_token_ids` default to the tokenizer's end-of-turn ids.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.log import get_logger, kv
from freetoken.server.errors import APIError, error_body
from freetoken.server.generation import (
    Plan,
    admit,
    new_id,
    parent_key_from,
    plan,
    session_key_from,
)
from freetoken.server.sse import (
    KEEPALIVE_S,
    TICK,
    EventStreamResponse,
    sse,
    sse_comment,
    with_ticks,
)
from freetoken.server.state import ServerState
from freetoken.server.validation import CommonParams, common_params, opt_dict, opt_str, read_json
from freetoken.types.api import Anchor, EngineEvent

log = get_logger("server")
ANCHOR_KINDS = {"head_end", "turn_start", "think_start", "think_end", "tool_call_start",
                "tool_result_start", "tool_result_end",
                "system_block",  # the agent proxy's head breaks (freetoken/proxy/heads.py)
                "tool_def"}  # a tool's line in the tools block (freetoken.chat.tokenizer)


async def health(request: Request) -> Response:
    st: ServerState = request.app.state.ft
    return JSONResponse({"status": "ok", "model": st.engine.model_name,
                         "max_context": st.engine.max_context})


async def stats(request: Request) -> Response:
    st: ServerState = request.app.state.ft
    return JSONResponse(st.engine.stats())


async def control_experts(request: Request) -> Response:
    from freetoken.engine.core import ResizeError
    from freetoken.types.api import AdmissionError

    st: ServerState = request.app.state.ft
    body = await read_json(request)
    if not isinstance(body, dict):
        raise APIError.bad("the body must be a JSON object")
    spec = {k: body[k] for k in ("slots", "rate", "mem") if k in body}
    for k, v in spec.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (k != "rate"
                                                                         and isinstance(v, float)):
            raise APIError.bad(f"'{k}' must be a {'number' if k == 'rate' else 'integer'}", k)
    resize = getattr(st.engine, "resize_experts", None)
    if resize is None:
        raise APIError(404, "this engine has no expert cache control", None, "not_supported")
    try:
        out = await resize(**spec)
    except AdmissionError as e:
        raise APIError.from_admission(e) from None
    except ResizeError as e:
        raise APIError(409, str(e), "slots", "allocation_failed") from None
    log.info(kv("control_experts", **out))
    return JSONResponse(out)


async def control_vram(request: Request) -> Response:
    """Rebuild the expert cache, the KV pool and the state pool now: `{"expert_slots": N,
    "kv_tokens": M, "state_slots": S}` (any may be left out: kept). 400 for sizes out of
    range, 409 when it could not allocate (rolled back, still serving), 404 without elastic
    VRAM."""
    from freetoken.engine.core import ResizeError
    from freetoken.types.api import AdmissionError

    st: ServerState = request.app.state.ft
    body = await read_json(request)
    if not isinstance(body, dict):
        raise APIError.bad("the body must be a JSON object")
    spec = {k: body[k] for k in ("expert_slots", "kv_tokens", "state_slots") if k in body}
    if not spec:
        raise APIError.bad("give expert_slots, kv_tokens, state_slots or several",
                           "expert_slots")
    for k, v in spec.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise APIError.bad(f"'{k}' must be an integer", k)
    rebuild = getattr(st.engine, "rebuild_vram", None)
    if rebuild is None:
        raise APIError(404, "this engine has no elastic VRAM", None, "not_supported")
    try:
        out = await rebuild(**spec)
    except AdmissionError as e:
        raise APIError(404 if e.code == "not_supported" else 400, e.message, e.param,
                       e.code) from None
    except ResizeError as e:
        raise APIError(409, str(e), None, "allocation_failed") from None
    log.info(kv("control_vram", **{k: v for k, v in out.items() if k != "reason"}))
    return JSONResponse(out)


def _ids(v: Any, param: str, limit: int, allow_empty: bool) -> list[int]:
    ok = isinstance(v, list) and (allow_empty or len(v) > 0) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in v)
    if not ok:
        raise APIError.bad(f"'{param}' must be a{'n' if allow_empty else ' non-empty'} array of "
                           f"token ids in [0, {limit})", param)
    return list(v)


def _anchors(v: Any, n: int) -> list[Anchor]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise APIError.bad("'anchors' must be an array", "anchors")
    out = []
    for i, a in enumerate(v):
        p = f"anchors[{i}]"
        pos = a.get("position") if isinstance(a, dict) else None
        if (not isinstance(a, dict) or isinstance(pos, bool) or not isinstance(pos, int)
                or not 0 <= pos <= n or not isinstance(a.get("kind"), str)
                or a["kind"] not in ANCHOR_KINDS):  # str first: a list kind is unhashable
            raise APIError.bad(f"'{p}' must be {{position: int in [0, {n}], kind: one of "
                               f"{sorted(ANCHOR_KINDS)}, role?, cut_point?}}", p)
        role, cut = a.get("role"), a.get("cut_point", False)
        if (role is not None and not isinstance(role, str)) or not isinstance(cut, bool):
            raise APIError.bad(f"'{p}.role' must be a string and 'cut_point' a boolean", p)
        out.append(Anchor(pos, a["kind"], role, cut))
    return out


def _native_plan(st: ServerState, body: dict, headers: Any) -> Plan:
    limit = st.vocab_limit()
    ids = _ids(body.get("input_ids"), "input_ids", limit, allow_empty=False)
    s = opt_dict(body, "sampling") or {}
    p: CommonParams = common_params(s, ("max_tokens",), "stop")
    if s.get("stop_token_ids") is None:
        stop_ids = list(st.tokenizer.eos_token_ids)
    else:
        stop_ids = _ids(s["stop_token_ids"], "sampling.stop_token_ids", limit, allow_empty=True)
    key = opt_str(body, "session_key") or session_key_from(headers)
    pl = plan(st.engine, ids, _anchors(body.get("anchors"), len(ids)), p, stop_ids, key,
              new_id("ftgen-"), "input_ids")
    # a sub-agent's parent session (#23): the body's, else (headers keying it) the headers'
    pl.req.parent_key = opt_str(body, "parent_key") or (
        None if opt_str(body, "session_key") else parent_key_from(headers))
    return pl


async def generate(request: Request) -> Response:
    st: ServerState = request.app.state.ft
    body = await read_json(request)
    pl = _native_plan(st, body, request.headers)
    log.info(kv("native_generate", request=pl.req.request_id, prompt=pl.prompt_len,
                anchors=len(pl.req.anchors), session=pl.req.session_key))
    gen = await admit(st.engine, pl)
    return EventStreamResponse(_stream(gen, pl), pl.headers, pl.req.request_id)


async def _events(gen: AsyncIterator[EngineEvent]) -> AsyncIterator[dict]:
    try:
        async for ev in gen:
            yield {"token_ids": list(ev.token_ids), "finished": ev.finished,
                   "finish_reason": ev.finish_reason, "prompt_tokens": ev.prompt_tokens,
                   "cached_tokens": ev.cached_tokens, "matched_stop_id": ev.matched_stop_id}
            if ev.finished:
                return
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()  # type: ignore[attr-defined]


async def _stream(gen: AsyncIterator[EngineEvent], pl: Plan) -> AsyncIterator[str]:
    try:
        async for ev in with_ticks(_events(gen), KEEPALIVE_S):
            yield sse_comment() if ev is TICK else sse(ev)
    except Exception as e:
        log.exception(kv("stream_error", request=pl.req.request_id))
        yield sse(error_body("openai", APIError(500, f"internal error: {e!r}")), "error")
