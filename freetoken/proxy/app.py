"""The agent proxy's starlette app.

Routes: `POST /v1/messages` (+ `/v1/messages/count_tokens`), `POST /v1/chat/completions`,
`GET /v1/models`, `GET /proxy/stats`, `GET /health`, behind the server's own front door
(`freetoken.server.guard.Guard`: Host/Origin, content types, body limits, the proxy's API key;
`limits.GuardedH11Protocol` under it for header timeouts and connection caps). Each request:
validate (`validate.check_body`, the server's checks: the same 4xx), pick the harness
adapter, run the normalisation pipeline, key the session, apply the output cap, then either
(native) run the server's own route for that API over `TurnEngine` (render, anchors with
predicted cut points, `/ft/v1/generate`, parse the output back into the client's events) or
(API mode) forward to the upstream (`forward.py`). Every request ends as one metrics record.
Errors are answered in the client's API shape with a 4xx for bad input, 502 for upstream
failures.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from freetoken.chat import ChatInputError, anthropic_to_template, openai_to_template
from freetoken.log import get_logger, kv
from freetoken.proxy import info_routes, responses
from freetoken.proxy.config import ProxyConfig
from freetoken.proxy.forward import forward
from freetoken.proxy.metrics import RequestRecord
from freetoken.proxy.native import Turn, TurnEngine
from freetoken.proxy.state import ProxyState, inner_request, template_rejects_mid_system
from freetoken.proxy.validate import check_body
from freetoken.server import anthropic_routes, openai_routes
from freetoken.server.errors import APIError, answer_errors
from freetoken.server.guard import Guard
from freetoken.server.limits import ServerLimits
from freetoken.server.sse import EventStreamResponse
from freetoken.server.state import ServerState
from harness_adapters import HarnessRequest, detect_adapter
from harness_adapters.base import first_user_text, system_text

__all__ = ["ProxyState", "create_proxy_app", "template_rejects_mid_system"]

log = get_logger("proxy")
CAP_HEADER = "x-ft-output-cap"


def _apply_cap(body: dict, api: str, cap: int | None) -> tuple[int | None, int | None]:
    """Lower the client's output limit to `cap`; returns (requested, cap if it applied)."""
    keys = ("max_tokens",) if api == "anthropic" else ("max_completion_tokens", "max_tokens")
    present = [k for k in keys if isinstance(body.get(k), int) and not isinstance(body[k], bool)]
    requested = body[present[0]] if present else None
    if cap is None or (requested is not None and requested <= cap):
        return requested, None
    for k in present or keys[-1:]:
        body[k] = cap
    # fields bounded by the output limit follow it down (#23: `min_tokens` left above the cap
    # turned 4 of 13 W4 turns into HTTP 400 "min_tokens exceeds max_tokens")
    for k in ("min_tokens",):
        if isinstance(body.get(k), int) and not isinstance(body[k], bool) and body[k] > cap:
            body[k] = cap
    think = body.get("thinking")
    if isinstance(think, dict) and isinstance(think.get("budget_tokens"), int) \
            and think["budget_tokens"] >= cap:  # Anthropic: budget_tokens < max_tokens
        body["thinking"] = dict(think, budget_tokens=max(cap - 1, 1))
    return requested, cap


async def _handle(request: Request, api: str, kind: str) -> Response:
    ps: ProxyState = request.app.state.proxy
    if api == "anthropic":
        await ps.probed()  # API mode: has the upstream /v1/messages? (else translate)
    raw = await request.body()
    try:
        body = check_body(api, kind, raw)  # before any adapter: they only see valid bodies
    except APIError as e:  # recorded under harness "invalid": no adapter saw it
        ps.metrics.record(RequestRecord(uuid.uuid4().hex[:16], "invalid", "", api, api,
                                        request.url.path, False, status=e.status,
                                        error=e.message[:300]))
        raise
    headers = {k.lower(): v for k, v in request.headers.items()}
    received = HarnessRequest(api, request.url.path, headers, body)
    adapter = detect_adapter(received, ps.cfg.force_harness)
    # one parse: detection is done with the body as received, so the pipeline may edit it
    norm, fired = adapter.normalise(received, ps.cfg.steps, ps.fold_system, copy=False)
    session = adapter.session_key(HarnessRequest(api, request.url.path, headers, norm))
    rid = uuid.uuid4().hex[:16]
    rec = RequestRecord(rid, adapter.name, session, api, "native" if ps.cfg.native else api,
                        request.url.path, bool(norm.get("stream")) and kind == "generate",
                        normalised=fired)
    if fired and log.isEnabledFor(logging.INFO):
        log.info(kv("normalise", request=rid, harness=adapter.name,
                    fired=",".join(f"{k}:{v}" for k, v in fired.items())))
    out_headers: dict[str, str] = {}
    if kind == "generate":
        rec.max_tokens_requested, cap = _apply_cap(norm, api, ps.cfg.cap_for(adapter.name))
        rec.max_tokens_sent = cap if cap is not None else rec.max_tokens_requested  # (native:
        # the engine's own clamp, set again by TurnEngine)
        if cap is not None:
            out_headers[CAP_HEADER] = str(cap)
    else:
        cap = None
    model = str(norm.get("model", ""))
    deferred = False
    try:
        if ps.cfg.native:
            resp = await _native(request, ps, norm, api, kind, adapter, session, rec, cap)
            deferred = kind == "generate"
        elif kind == "count":
            resp = await info_routes.count_upstream(request, ps, norm, api)
        else:
            msgs = norm.get("messages") if isinstance(norm.get("messages"), list) else []
            ep = ps.sessions.observe_messages(session, msgs)
            rec.edit_kind, rec.edit_unit = ep.kind, ep.unit
            rec.edit_position, rec.edit_block = ep.position, ep.block
            resp = await forward(ps.upstream(), request, norm, api, rec, model, cap,
                                 out_headers, ps.record,
                                 raw if not fired and cap is None else None)
            deferred = isinstance(resp, EventStreamResponse)
        if resp.status_code >= 400:
            rec.status = resp.status_code
        for k, v in out_headers.items():
            resp.headers.setdefault(k, v)
        return resp
    except APIError as e:
        rec.status, rec.error = e.status, e.message
        deferred = False
        raise
    finally:
        if not deferred:
            ps.record(rec)


async def _native(request: Request, ps: ProxyState, body: dict, api: str, kind: str,
                  adapter: Any, session: str, rec: RequestRecord, cap: int | None) -> Response:
    eng = await ps.native()
    try:
        ti = (anthropic_to_template if api == "anthropic" else openai_to_template)(body)
        messages = ti.messages
    except ChatInputError:
        messages = []  # the route answers the 400
    parent = adapter.parent_key(HarnessRequest(  # #23: sub-agent lineage for the cache
        api, request.url.path, {k.lower(): v for k, v in request.headers.items()}, body))
    turn = TurnEngine(eng, Turn(adapter, session, messages, rec, cap, system_text(body),
                                adapter.head_breaks(body), parent, first_user_text(body),
                                adapter.user_breaks(body)), ps.sessions,
                      ps.metrics.record, ps.heads)
    names = ps.cfg.served_model_names or [eng.model_name]
    st = ServerState(turn, ps.tokenizer, None, names, False, ps.parser_family)  # type: ignore[arg-type]
    inner = inner_request(request, body, st)
    if kind == "count":
        return await anthropic_routes.count_tokens(inner)
    if kind == "models":
        return await openai_routes.models(inner)
    fn = anthropic_routes.messages if api == "anthropic" else openai_routes.chat_completions
    return await fn(inner)


def _endpoint(api: str, kind: str) -> Any:
    async def handler(request: Request) -> Response:
        return await answer_errors(request, api, lambda: _handle(request, api, kind), log)

    return handler


def create_proxy_app(cfg: ProxyConfig, tokenizer: Any = None, parser_family: str = "qwen3",
                     client: httpx.AsyncClient | None = None,
                     limits: ServerLimits | None = None) -> Guard:
    """The proxy app behind its `Guard` (`limits`: `ServerLimits()` by default; the key is
    `cfg.api_key`). Native mode needs `tokenizer` (a ChatTokenizer of the engine's model);
    API mode uses it only for count_tokens against an OpenAI-only upstream."""
    if cfg.native and tokenizer is None:
        raise ValueError("native mode needs the engine's tokenizer")
    routes = [
        Route("/v1/messages", _endpoint("anthropic", "generate"), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint("anthropic", "count"), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint("openai", "generate"), methods=["POST"]),
        Route("/v1/models", info_routes.models, methods=["GET"]),
        Route("/proxy/stats", info_routes.stats, methods=["GET"]),
        Route("/health", info_routes.health, methods=["GET"]),
        *responses.routes(_handle),  # /v1/responses, translated to the chat handling above
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: info_routes.http_error,
                                                       Exception: info_routes.unhandled})
    app.state.proxy = ProxyState(cfg, tokenizer, parser_family, client)
    log.info(kv("proxy_app", mode="native" if cfg.native else "upstream",
                upstream=cfg.upstream or cfg.native_url, caps=cfg.caps,
                fold_system=app.state.proxy.fold_system, auth=bool(cfg.api_key)))
    return Guard(app, limits or ServerLimits(), cfg.api_key)
