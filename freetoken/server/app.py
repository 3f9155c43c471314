"""The app of `ft serve`: the `Guard` layer (host, origin, content type, body limits), routes,
API-key auth, and error shapes.

The `Guard` in front checks the API key (`Authorization: Bearer K` or `x-api-key: K`; /health is
open; see `auth.py`). Every handler runs inside `_endpoint`, which turns `APIError` into the
error shape of the path's API family, and any other exception into a logged 500 in that shape (a
bug: validation is meant to refuse all bad input first). Unknown routes get 404 and wrong methods
405, in the same shapes.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from freetoken.chat.output import FAMILIES
from freetoken.log import get_logger, kv
from freetoken.server import anthropic_routes, native_routes, openai_routes, responses_routes
from freetoken.server.errors import APIError, answer_errors, error_response, request_family
from freetoken.server.guard import Guard
from freetoken.server.limits import ServerLimits
from freetoken.server.responses_routes import ResponseStore
from freetoken.server.state import ServerState
from freetoken.types.api import EngineClient

log = get_logger("server")
Handler = Callable[[Request], Awaitable[Response]]


def _endpoint(fn: Handler, open_route: bool = False) -> Handler:
    """`open_route`: reachable without the API key (the `Guard` checks keys; kept here so the
    route table says which routes are open)."""

    async def wrapped(request: Request) -> Response:
        return await answer_errors(request, request_family(request), lambda: fn(request), log)

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


async def _responses_create(request: Request) -> Response:
    return await responses_routes.create_response(request, request.app.state.responses,
                                                  openai_routes.chat_completions)


async def _responses_get(request: Request) -> Response:
    return await responses_routes.get_response(request, request.app.state.responses)


def create_app(engine: EngineClient, tokenizer: Any, *, api_key: str | None,
               served_model_names: list[str], strict_model: bool = False,
               parser_family: str = "qwen3", limits: ServerLimits | None = None) -> Guard:
    """The HTTP app serving `engine` with `tokenizer` (a `freetoken.chat.ChatTokenizer`).

    `served_model_names` are listed by /v1/models (default: the engine's model name); any
    requested model name is answered unless `strict_model`, then unknown names get 404
    `model_not_found`. `parser_family` picks the reasoning/tool-call output parser. `limits`:
    allowed hosts, body limits, stream stall timeout (defaults: `ServerLimits()`)."""
    limits = limits or ServerLimits()
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
        Route("/v1/responses", _endpoint(_responses_create), methods=["POST"]),
        Route("/v1/responses/{response_id}", _endpoint(_responses_get), methods=["GET"]),
        Route("/ft/v1/generate", _endpoint(native_routes.generate), methods=["POST"]),
        Route("/ft/v1/control/experts", _endpoint(native_routes.control_experts),
              methods=["POST"]),
        Route("/ft/v1/control/vram", _endpoint(native_routes.control_vram), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error,
                                                       Exception: _unhandled})
    app.state.ft = ServerState(engine, tokenizer, api_key, names, strict_model, parser_family,
                               stall_timeout_s=limits.stall_timeout_s)
    app.state.responses = ResponseStore()  # /v1/responses state (previous_response_id)
    log.info(kv("app", model=engine.model_name, names=",".join(names), strict=strict_model,
                auth=bool(api_key), max_context=engine.max_context,
                allowed_hosts=",".join(limits.allowed_hosts) or "local"))
    guard = Guard(app, limits, api_key)
    app.state.auth_failures = guard.auth_failures
    return guard
