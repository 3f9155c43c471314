"""The proxy's validation of a request body, before any adapter or normalisation step sees it:
the server's own checks in the server's order (`freetoken.server.validation` for the JSON text
and the sampling fields, the one walk per API `freetoken.server.state.chat_request` for
messages, tools, tool_choice and thinking, and the OpenAI route's own refusals), so a body the
server would refuse gets the same 4xx from the proxy, in the client's API shape, in every mode.
The adapters then only ever see bodies that passed (`harness_adapters` rely on it).

One difference: NaN and Infinity constants are refused here (the server reads them as numbers
and then refuses them where a number is checked; the proxy forwards bodies, and one upstream
reads them as null while another refuses the request).
"""
from __future__ import annotations

from typing import Any

from freetoken.server.errors import APIError
from freetoken.server.openai_routes import _no_logprobs, _only_n1, _stream_opts
from freetoken.server.state import chat_request
from freetoken.server.validation import (
    common_params,
    opt_bool,
    opt_dict,
    opt_int,
    parse_json,
    req_str,
)


def check_body(api: str, kind: str, raw: bytes) -> dict[str, Any]:
    """The parsed body of a `kind` ('generate' or 'count') request in `api`, or APIError."""
    body = parse_json(raw, constants=False)
    req_str(body, "model")
    if api == "anthropic":
        if kind == "generate":
            if body.get("max_tokens") is None:
                raise APIError.bad("max_tokens: Field required", "max_tokens", "missing_field")
            common_params(body, ("max_tokens",), "stop_sequences")
            opt_bool(body, "stream")
        chat_request("anthropic", body)
        return body
    chat_request("openai", body)
    _only_n1(body)
    _no_logprobs(opt_bool(body, "logprobs") or bool(opt_int(body, "top_logprobs", lo=0, hi=20)))
    rf = opt_dict(body, "response_format")
    if rf is not None and rf.get("type") not in (None, "text"):
        raise APIError.bad("response_format other than 'text' is not supported (no constrained "
                           "decoding)", "response_format")
    _stream_opts(body)
    common_params(body, ("max_completion_tokens", "max_tokens"), "stop")
    return body
