"""Error shapes of the two API families, and the one exception type handlers raise.

Every error the server sends is an `APIError` rendered in the shape of the API family of the
request path: OpenAI `{"error": {"message", "type", "param", "code"}}`, Anthropic
`{"type": "error", "error": {"type", "message"}}`. The native `/ft/...` routes use the OpenAI
shape. The same bodies are sent as an SSE `error` event once a stream has started.
"""
from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.types.api import AdmissionError, EngineBusy

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
_OPENAI_PREFIXES = ("/v1/chat/", "/v1/completions", "/v1/models", "/v1/stats", "/ft/",
                    "/health")
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "server_error",
                 503: "server_error"}


class APIError(Exception):
    """A request that gets an error answer: `status` is the HTTP status, `param` the offending
    request field (dotted path) when there is one, `code` a stable machine-readable reason."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (e.g. retry-after of a 503)

    @classmethod
    def bad(cls, message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
        return cls(400, message, param, code)

    @classmethod
    def from_admission(cls, e: AdmissionError) -> APIError:
        """400, or 503 with Retry-After for an engine that is rebuilding (`EngineBusy`)."""
        if isinstance(e, EngineBusy):
            return cls(503, e.message, e.param, e.code, {"retry-after": str(e.retry_after)})
        return cls(400, e.message, e.param, e.code)


def family_of(path: str, headers: dict[str, str] | None = None) -> str:
    """'anthropic' for /v1/messages*, 'openai' for the OpenAI and native (/ft/) routes; other
    paths (unknown routes) follow the client: Anthropic when it sends `anthropic-version`."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith(_OPENAI_PREFIXES):
        return "openai"
    if headers is not None and "anthropic-version" in headers and not path.startswith("/ft/"):
        return "anthropic"
    return "openai"


def error_body(family: str, err: APIError) -> dict:
    if family == "anthropic":
        etype = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500
                                     else "invalid_request_error")
        return {"type": "error", "error": {"type": etype, "message": err.message}}
    etype = _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500
                              else "invalid_request_error")
    return {"error": {"message": err.message, "type": etype, "param": err.param,
                      "code": err.code}}


def error_response(family: str, err: APIError, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    return JSONResponse(error_body(family, err), status_code=err.status, headers=headers)


def request_family(request: Request) -> str:
    return family_of(request.url.path, {k.lower(): v for k, v in request.headers.items()})


async def answer_errors(request: Request, family: str, call, log: logging.Logger) -> Response:
    """`await call()`, with an `APIError` answered in the API's own shape (one `reject` line on
    `log`) and anything unexpected as a 500 with its traceback logged (`internal_error`)."""
    from freetoken.log import kv

    try:
        return await call()
    except APIError as e:
        log.info(kv("reject", path=request.url.path, status=e.status, param=e.param,
                    reason=e.message[:200]))
        return error_response(family, e, headers=e.headers)
    except Exception as e:
        log.exception(kv("internal_error", path=request.url.path))
        return error_response(family, APIError(500, f"internal error: {e!r}", None,
                                               "internal_error"))
