"""`POST /v1/responses` and `GET /v1/responses/{id}` on the proxy, for any mode: the Responses
request becomes a chat completions request handled exactly like one the client sent (adapter,
normalisation, session, output cap, native engine or any upstream behind it, metrics), and the
chat answer is translated back (`freetoken/server/responses_routes.py`). Translating always,
rather than forwarding to an upstream's own `/v1/responses`, keeps the history's rendering ours:
byte-stable across turns, so prefix reuse holds with any engine behind the proxy."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from freetoken.log import get_logger
from freetoken.server import responses_routes
from freetoken.server.errors import answer_errors
from freetoken.server.responses_routes import ResponseStore

log = get_logger("proxy")
Handle = Callable[[Request, str, str], Awaitable[Response]]


def routes(handle: Handle) -> list[Route]:
    """The routes; `handle(request, api, kind)` is the proxy's own request handling."""
    store = ResponseStore()

    async def create(request: Request) -> Response:
        return await answer_errors(request, "openai", lambda: responses_routes.create_response(
            request, store, lambda inner: handle(inner, "openai", "generate")), log)

    async def get(request: Request) -> Response:
        return await answer_errors(request, "openai",
                                   lambda: responses_routes.get_response(request, store), log)

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", get, methods=["GET"])]
