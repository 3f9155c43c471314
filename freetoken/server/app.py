"""The starlette app of `ft serve`: routes, API-key auth, and error shapes.

Every handler runs inside `_endpoint`, which checks the API key (`Authorization: Bearer K` or
`x-api-key: K`; /health is open), turns `APIError` into the error shape of the path's API family,
and turns any other exception into a logged 500 in that shape (a bug: validation is meant to
refuse all bad input first). Unknown routes get 404 and wrong methods 405, in the same shapes.
"""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from freetoken.chat.output import FAMILIES
from freetoken.log import get_logger, kv
from freetoken.server import anthropic_routes, native_routes, openai_routes
from freetoken.server.errors import APIError, error_response, request_family
from freetoken.server.state import ServerState
from freetoken.types.api import EngineClient

log = get_logger("server")
Handler = Callable[[Request], Awaitable[Response]]


def _authorized(request: Request, key: str) -> bool:
    auth = request.headers.get("authorization", "")
    offered = [request.headers.get("x-api-key", "")]
    if auth[:7].lower() == "bearer ":
        offered.append(auth[7:].strip())
    return any(o and hmac.compare_digest(o.encode(), key.encode()) for o in offered)


def _endpoint(fn: Handler, open_route: bool = False) -> Handler:
    async def wrapped(request: Request) -> Response:
        family = request_family(request)
        st: ServerState = request.app.state.ft
        if not open_route and st.api_key and not _authorized(request, st.api_key):
            return error_response(family, APIError(
                401, "invalid or missing API key (send 'Authorization: Bearer KEY' or "
                "'x-api-key: KEY')", None, "invalid_api_key"))
        try:
            return await fn(request)
        except APIError as e:
            log.info(kv("reject", path=request.url.path, status=e.status, param=e.param,
                        reason=e.message[:200]))
            return error_response(family, e)
        except Exception as e:
            log.exception(kv("internal_error", path=request.url.path))
            return error_response(family, APIError(500, f"internal error: {e!r}", None,
                                                   "internal_error"))

    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    msg = {404: f"no route {request.method} {request.url.path}",
           405: f"method {request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(request_family(request), APIError(exc.status_code, msg, None, code),
                          headers=getattr(exc, "headers", None))


async def _unhandled(request: Request, exc: Exception) -> Response:
    log.exception(kv("internal_error", path=request.url.path), exc_info=exc)
    return error_response(request_family(request),
                          APIError(500, f"internal error: {exc!r}", None, "internal_error"))


def create_app(engine: EngineClient, tokenizer: Any, *, api_key: str | None,
               served_model_names: list[str], strict_model: bool = False,
               parser_family: str = "qwen3") -> Starlette:
    """The HTTP app serving `engine` with `tokenizer` (a `freetoken.chat.ChatTokenizer`).

    `served_model_names` are listed by /v1/models (default: the engine's model name); any
    requested model name is answered unless `strict_model`, then unknown names get 404
    `model_not_found`. `parser_family` picks the reasoning/tool-call output parser."""
    if parser_family not in FAMILIES:
        raise ValueError(f"unknown parser family {parser_family!r}; known: {sorted(FAMILIES)}")
    names = list(served_model_names) or [engine.model_name]
    routes = [
        Route("/health", _endpoint(native_routes.health, open_route=True), methods=["GET"]),
        Route("/v1/stats", _endpoint(native_routes.stats), methods=["GET"]),
        Route("/v1/models", _endpoint(openai_routes.models), methods=["GET"]),
        Route("/v1/chat/completions", _endpoint(openai_routes.chat_completions),
              methods=["POST"]),
        Route("/v1/completions", _endpoint(openai_routes.completions), methods=["POST"]),
        Route("/v1/messages", _endpoint(anthropic_routes.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint(anthropic_routes.count_tokens),
              methods=["POST"]),
        Route("/ft/v1/generate", _endpoint(native_routes.generate), methods=["POST"]),
        Route("/ft/v1/control/experts", _endpoint(native_routes.control_experts),
              methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error,
                                                       Exception: _unhandled})
    app.state.ft = ServerState(engine, tokenizer, api_key, names, strict_model, parser_family)
    log.info(kv("app", model=engine.model_name, names=",".join(names), strict=strict_model,
                auth=bool(api_key), max_context=engine.max_context))
    return app
