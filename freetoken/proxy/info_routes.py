"""The proxy's routes besides generation: count_tokens in API mode, /v1/models, /proxy/stats,
/health, and 404/405 in the client's API shape."""
from __future__ import annotations

import httpx
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.chat import ChatInputError, anthropic_to_template
from freetoken.proxy.state import ProxyState, inner_request
from freetoken.proxy.translate_stream import json_or_none
from freetoken.server import openai_routes
from freetoken.server.errors import APIError, error_response, family_of
from freetoken.server.state import ServerState


async def count_upstream(request: Request, ps: ProxyState, body: dict, api: str) -> Response:
    up = ps.upstream()
    if up.api_out("anthropic") == "anthropic":
        from freetoken.proxy.relay import unreachable
        from freetoken.proxy.upstream import error_from

        try:
            r = await ps.client.post(up.url("anthropic", count_tokens=True), json=body,
                                     headers=up.headers(request.headers, "anthropic"),
                                     timeout=httpx.Timeout(up.total_s,
                                                           connect=ps.cfg.connect_timeout_s))
        except httpx.HTTPError as e:
            raise unreachable(e) from None
        if r.status_code >= 400:  # the upstream's refusal, its status, our shape
            raise error_from(r.status_code, r.content)
        if not isinstance(json_or_none(r.text), dict):
            raise APIError(502, "upstream answered count_tokens with no JSON object", None,
                           "upstream_protocol")
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


async def models(request: Request) -> Response:
    ps: ProxyState = request.app.state.proxy
    try:
        if ps.cfg.native:
            eng = await ps.native()
            names = ps.cfg.served_model_names or [eng.model_name]
            st = ServerState(eng, ps.tokenizer, None, names)  # type: ignore[arg-type]
            return await openai_routes.models(inner_request(request, {}, st))
        up = ps.upstream()
        r = await ps.client.get(up.base_url + "/v1/models",
                                headers=up.headers(request.headers, up.api_out("openai")),
                                timeout=httpx.Timeout(up.idle_s, connect=ps.cfg.connect_timeout_s))
        return Response(r.content, r.status_code, media_type="application/json")
    except (APIError, httpx.HTTPError) as e:
        err = e if isinstance(e, APIError) else APIError(502, f"upstream: {e!r}", None,
                                                         "upstream_error")
        return error_response("openai", err)


async def stats(request: Request) -> Response:
    ps: ProxyState = request.app.state.proxy
    cfg = ps.cfg
    page = []
    for name, default in (("sessions", 50), ("offset", 0)):
        v = request.query_params.get(name, str(default))
        if not (v.isdigit() and len(v) < 10):
            return error_response("openai", APIError.bad(f"'{name}' must be a non-negative "
                                                         "integer", name))
        page.append(int(v))
    info = await ps.probed()
    return JSONResponse({**ps.metrics.stats(*page), "mode": "native" if cfg.native else "upstream",
                         "upstream_limits": info.as_dict() if info else None,
                         "upstream": cfg.upstream or cfg.native_url, "caps": cfg.caps,
                         "steps": cfg.steps, "fold_system": ps.fold_system})


async def http_error(request: Request, exc: Exception) -> Response:
    """Unknown routes (404) and wrong methods (405) in the client's API shape."""
    assert isinstance(exc, HTTPException)
    msg = {404: f"no route {request.method} {request.url.path} on this proxy",
           405: f"method {request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    family = family_of(request.url.path, {k.lower(): v for k, v in request.headers.items()})
    return error_response(family, APIError(exc.status_code, msg, None, "not_found"
                                           if exc.status_code == 404 else "invalid_request"))


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok", "proxy": True})


async def unhandled(request: Request, exc: Exception) -> Response:
    """A bug: logged with its traceback, answered as a 500 in the client's shape."""
    from freetoken.log import get_logger, kv

    get_logger("proxy").exception(kv("internal_error", path=request.url.path), exc_info=exc)
    family = family_of(request.url.path, {k.lower(): v for k, v in request.headers.items()})
    return error_response(family, APIError(500, f"internal error: {exc!r}", None,
                                           "internal_error"))
