"""The agent proxy's starlette app.

Routes: `POST /v1/messages` (+ `/v1/messages/count_tokens`), `POST /v1/chat/completions`,
`GET /v1/models`, `GET /proxy/stats`, `GET /health`. Each request: parse, pick the harness
adapter, run the normalisation pipeline, key the session, apply the output cap, then either
(native) run the server's own route for that API over `TurnEngine` (render, anchors with
predicted cut points, `/ft/v1/generate`, parse the output back into the client's events) or
(API mode) forward to the upstream (`forward.py`). Every request ends as one metrics record.
Errors are answered in the client's API shape with a 4xx for bad input, 502 for upstream
failures.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from freetoken.chat import ChatInputError, anthropic_to_template, openai_to_template
from freetoken.log import get_logger, kv
from freetoken.proxy.config import ProxyConfig
from freetoken.proxy.forward import forward
from freetoken.proxy.metrics import Metrics, RequestRecord
from freetoken.proxy.native import NativeEngine, Turn, TurnEngine
from freetoken.proxy.sessions import SessionStore
from freetoken.proxy.upstream import Upstream
from freetoken.server import anthropic_routes, openai_routes
from freetoken.server.errors import APIError, error_response
from freetoken.server.sse import EventStreamResponse
from freetoken.server.state import ServerState
from harness_adapters import HarnessRequest, detect_adapter

log = get_logger("proxy")
CAP_HEADER = "x-ft-output-cap"


def template_rejects_mid_system(tokenizer: Any) -> bool:
    """True when the chat template cannot render a system message after the first turn."""
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "system", "content": "c"}, {"role": "user", "content": "d"}]
    try:
        tokenizer.render(msgs)
        return False
    except Exception:  # noqa: BLE001 - any refusal of the template means "fold"
        return True


class ProxyState:
    def __init__(self, cfg: ProxyConfig, tokenizer: Any = None, parser_family: str = "qwen3",
                 client: httpx.AsyncClient | None = None) -> None:
        self.cfg, self.tokenizer, self.parser_family = cfg, tokenizer, parser_family
        self._client = client
        self.metrics = Metrics(cfg.metrics_path)
        self.sessions = SessionStore()
        self._native: NativeEngine | None = None
        self._lock: asyncio.Lock | None = None
        fold = cfg.fold_system
        self.fold_system = fold == "fold" or (fold == "auto" and tokenizer is not None
                                              and template_rejects_mid_system(tokenizer))

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # created in the serving loop; no pool limit: never serialise
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=self.cfg.connect_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._client

    def upstream(self) -> Upstream:
        assert self.cfg.upstream is not None
        return Upstream(self.cfg.upstream, self.cfg.upstream_api, self.client,
                        self.cfg.upstream_api_key, self.cfg.ping_s)

    async def native(self) -> NativeEngine:
        if self._native is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._native is None:
                    assert self.cfg.native_url is not None
                    try:
                        key = self.cfg.upstream_api_key  # an `ft serve --api-key` engine
                        auth = {"authorization": f"Bearer {key}"} if key else None
                        self._native = await NativeEngine.connect(self.cfg.native_url,
                                                                  self.client, auth)
                    except httpx.HTTPError as e:
                        raise APIError(502, f"engine unreachable at {self.cfg.native_url}: "
                                       f"{e!r}", None, "upstream_error") from None
        return self._native


def _inner_request(request: Request, body: dict, st: ServerState) -> Request:
    """The same request with the normalised body and an app whose state is `st`."""
    data = json.dumps(body).encode()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await request.receive()

    scope = dict(request.scope)
    scope["app"] = SimpleNamespace(state=SimpleNamespace(ft=st))
    return Request(scope, receive)


def _apply_cap(body: dict, api: str, cap: int | None) -> tuple[int | None, int | None]:
    """Lower the client's output limit to `cap`; returns (requested, cap if it applied)."""
    keys = ("max_tokens",) if api == "anthropic" else ("max_completion_tokens", "max_tokens")
    present = [k for k in keys if isinstance(body.get(k), int) and not isinstance(body[k], bool)]
    requested = body[present[0]] if present else None
    if cap is None or (requested is not None and requested <= cap):
        return requested, None
    for k in present or keys[-1:]:
        body[k] = cap
    return requested, cap


async def _handle(request: Request, api: str, kind: str) -> Response:
    ps: ProxyState = request.app.state.proxy
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError.bad("request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError.bad("request body must be a JSON object", code="invalid_json")
    headers = {k.lower(): v for k, v in request.headers.items()}
    adapter = detect_adapter(HarnessRequest(api, request.url.path, headers, body),
                             ps.cfg.force_harness)
    work = HarnessRequest(api, request.url.path, headers, json.loads(raw))  # a private copy
    norm, fired = adapter.normalise(work, ps.cfg.steps, ps.fold_system, copy=False)
    session = adapter.session_key(HarnessRequest(api, request.url.path, headers, norm))
    rid = uuid.uuid4().hex[:16]
    rec = RequestRecord(rid, adapter.name, session, api, "native" if ps.cfg.native else api,
                        request.url.path, bool(norm.get("stream")) and kind == "generate",
                        normalised=fired)
    if fired:
        log.info(kv("normalise", request=rid, harness=adapter.name,
                    fired=",".join(f"{k}:{v}" for k, v in fired.items())))
    out_headers: dict[str, str] = {}
    if kind == "generate":
        rec.max_tokens_requested, cap = _apply_cap(norm, api, ps.cfg.cap_for(adapter.name))
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
            resp = await _count_upstream(request, ps, norm, api)
        else:
            msgs = norm.get("messages") if isinstance(norm.get("messages"), list) else []
            ep = ps.sessions.observe_messages(session, msgs)
            rec.edit_kind, rec.edit_unit = ep.kind, ep.unit
            rec.edit_position, rec.edit_block = ep.position, ep.block
            resp = await forward(ps.upstream(), request, norm, api, rec, model, cap,
                                 out_headers, ps.metrics.record,
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
            ps.metrics.record(rec)


async def _native(request: Request, ps: ProxyState, body: dict, api: str, kind: str,
                  adapter: Any, session: str, rec: RequestRecord, cap: int | None) -> Response:
    eng = await ps.native()
    try:
        ti = (anthropic_to_template if api == "anthropic" else openai_to_template)(body)
        messages = ti.messages
    except ChatInputError:
        messages = []  # the route answers the 400
    turn = TurnEngine(eng, Turn(adapter, session, messages, rec, cap), ps.sessions,
                      ps.metrics.record)
    names = ps.cfg.served_model_names or [eng.model_name]
    st = ServerState(turn, ps.tokenizer, None, names, False, ps.parser_family)  # type: ignore[arg-type]
    inner = _inner_request(request, body, st)
    if kind == "count":
        return await anthropic_routes.count_tokens(inner)
    if kind == "models":
        return await openai_routes.models(inner)
    fn = anthropic_routes.messages if api == "anthropic" else openai_routes.chat_completions
    return await fn(inner)


async def _count_upstream(request: Request, ps: ProxyState, body: dict, api: str) -> Response:
    up = ps.upstream()
    if up.api_out("anthropic") == "anthropic":
        r = await ps.client.post(up.url("anthropic", count_tokens=True), json=body,
                                 headers=up.headers(request.headers, "anthropic"))
        return Response(r.content, r.status_code, media_type="application/json")
    if ps.tokenizer is None:
        raise APIError(404, "count_tokens needs an Anthropic upstream or --tokenizer", None,
                       "not_supported")
    try:
        ti = anthropic_to_template(body)
        prompt = ps.tokenizer.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking)
    except ChatInputError as e:
        raise APIError.bad(e.message, e.param) from None
    return JSONResponse({"input_tokens": len(prompt.input_ids)})


def _endpoint(api: str, kind: str) -> Any:
    async def handler(request: Request) -> Response:
        try:
            return await _handle(request, api, kind)
        except APIError as e:
            log.info(kv("reject", path=request.url.path, status=e.status, reason=e.message[:200]))
            return error_response(api, e)
        except Exception as e:
            log.exception(kv("internal_error", path=request.url.path))
            return error_response(api, APIError(500, f"internal error: {e!r}", None,
                                                "internal_error"))

    return handler


async def models(request: Request) -> Response:
    ps: ProxyState = request.app.state.proxy
    try:
        if ps.cfg.native:
            eng = await ps.native()
            names = ps.cfg.served_model_names or [eng.model_name]
            st = ServerState(eng, ps.tokenizer, None, names)  # type: ignore[arg-type]
            return await openai_routes.models(_inner_request(request, {}, st))
        up = ps.upstream()
        r = await ps.client.get(up.base_url + "/v1/models",
                                headers=up.headers(request.headers, up.api_out("openai")))
        return Response(r.content, r.status_code, media_type="application/json")
    except (APIError, httpx.HTTPError) as e:
        err = e if isinstance(e, APIError) else APIError(502, f"upstream: {e!r}", None,
                                                         "upstream_error")
        return error_response("openai", err)


async def stats(request: Request) -> Response:
    ps: ProxyState = request.app.state.proxy
    cfg = ps.cfg
    return JSONResponse({**ps.metrics.stats(), "mode": "native" if cfg.native else "upstream",
                         "upstream": cfg.upstream or cfg.native_url, "caps": cfg.caps,
                         "steps": cfg.steps, "fold_system": ps.fold_system})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok", "proxy": True})


def create_proxy_app(cfg: ProxyConfig, tokenizer: Any = None, parser_family: str = "qwen3",
                     client: httpx.AsyncClient | None = None) -> Starlette:
    """The proxy app. Native mode needs `tokenizer` (a ChatTokenizer of the engine's model);
    API mode uses it only for count_tokens against an OpenAI-only upstream."""
    if cfg.native and tokenizer is None:
        raise ValueError("native mode needs the engine's tokenizer")
    routes = [
        Route("/v1/messages", _endpoint("anthropic", "generate"), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint("anthropic", "count"), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint("openai", "generate"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/proxy/stats", stats, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.proxy = ProxyState(cfg, tokenizer, parser_family, client)
    log.info(kv("proxy_app", mode="native" if cfg.native else "upstream",
                upstream=cfg.upstream or cfg.native_url, caps=cfg.caps,
                fold_system=app.state.proxy.fold_system))
    return app
