"""Request-body validation shared by all routes: every malformed input becomes an `APIError`
(400) here, before anything reaches the chat template or the engine.

Rules: booleans are never accepted as numbers, integers never as strings; fields that are
absent or JSON null take their default; the body must be UTF-8 JSON (RFC 8259: UTF-16/32 bodies,
which Python's `json.loads` would silently accept, are refused) holding an object nested at most
`MAX_DEPTH` deep (deeper bodies are refused rather than risking recursion limits later), with no
lone UTF-16 surrogate escape (`"\\ud800"`): such a string cannot be tokenized nor encoded
back into a response, so it is refused here instead of failing after generation.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from freetoken.chat.json_limits import MAX_DEPTH, SURROGATE_ESCAPE_B, has_lone_surrogate, too_deep
from freetoken.server.errors import APIError

MAX_STOPS = 16
MAX_STOP_LEN = 1024


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or APIError 400 (`invalid_json`)."""
    return parse_json(await request.body())


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes, constants: bool = True) -> dict[str, Any]:
    """`constants`: read NaN / Infinity / -Infinity as numbers (what `json` does; the fields
    that take numbers refuse them); False refuses them here (the proxy, which forwards)."""
    if not raw.strip():
        raise APIError.bad("request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
        body = json.loads(text) if constants else json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise APIError.bad(f"request body is not UTF-8: {e}", code="invalid_json") from None
    except (ValueError, RecursionError) as e:
        raise APIError.bad(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError.bad("request body must be a JSON object", code="invalid_json")
    check_depth(body)
    if SURROGATE_ESCAPE_B.search(raw) and has_lone_surrogate(body):
        raise APIError.bad("request body contains a lone UTF-16 surrogate escape (e.g. "
                           "'\\ud800' without its pair); strings must be valid Unicode",
                           code="invalid_json")
    return body


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    if too_deep(value, limit):
        raise APIError.bad(f"request body is nested deeper than {limit} levels",
                           code="invalid_json")


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null"}.get(type(v), "number")


def opt_int(body: dict, key: str, *, lo: int | None = None, hi: int | None = None,
            param: str | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    p = param or key
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError.bad(f"'{p}' must be an integer, got {_type_name(v)}", p)
    if lo is not None and v < lo:
        raise APIError.bad(f"'{p}' must be >= {lo}, got {v}", p)
    if hi is not None and v > hi:
        raise APIError.bad(f"'{p}' must be <= {hi}, got {v}", p)
    return v


def opt_num(body: dict, key: str, *, lo: float, hi: float, lo_open: bool = False,
            param: str | None = None) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    p = param or key
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError.bad(f"'{p}' must be a number, got {_type_name(v)}", p)
    f = float(v)
    if math.isnan(f) or f > hi or f < lo or (lo_open and f == lo):
        lo_b = "(" if lo_open else "["
        raise APIError.bad(f"'{p}' must be in {lo_b}{lo}, {hi}], got {v}", p)
    return f


def opt_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError.bad(f"'{key}' must be a boolean, got {_type_name(v)}", key)
    return v


def opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise APIError.bad(f"'{key}' must be a string, got {_type_name(v)}", key)
    return v


def req_str(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        what = "is required" if v is None else "must be a non-empty string"
        raise APIError.bad(f"'{key}' {what}", key, "missing_field" if v is None else
                           "invalid_request")
    return v


def opt_dict(body: dict, key: str) -> dict | None:
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        raise APIError.bad(f"'{key}' must be an object, got {_type_name(v)}", key)
    return v


def stop_list(v: Any, param: str) -> list[str]:
    """`stop` as a string or a list of non-empty strings (at most MAX_STOPS)."""
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise APIError.bad(f"'{param}' must be a string or an array of strings", param)
    if len(items) > MAX_STOPS:
        raise APIError.bad(f"'{param}' has {len(items)} entries; at most {MAX_STOPS}", param)
    for s in items:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN:
            raise APIError.bad(f"'{param}' entries must be non-empty strings of at most "
                               f"{MAX_STOP_LEN} characters", param)
    return list(dict.fromkeys(items))


@dataclass
class CommonParams:
    """Sampling fields both API families map onto `SamplingParams` (plus stop strings)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stops: list[str] = field(default_factory=list)


def common_params(body: dict, max_keys: tuple[str, ...], stop_key: str) -> CommonParams:
    """Read sampling fields. `max_keys` are tried in order (first present wins); top_k -1 means
    off (the vLLM convention), as does 0."""
    max_tokens = None
    for k in max_keys:
        max_tokens = opt_int(body, k, lo=1)
        if max_tokens is not None:
            break
    temperature = opt_num(body, "temperature", lo=0.0, hi=100.0)
    top_p = opt_num(body, "top_p", lo=0.0, hi=1.0, lo_open=True)
    top_k = opt_int(body, "top_k", lo=-1, hi=1 << 31)
    seed = opt_int(body, "seed", lo=0, hi=2**63 - 1)
    min_tokens = opt_int(body, "min_tokens", lo=0, hi=1 << 31) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError.bad(f"'min_tokens' ({min_tokens}) exceeds max_tokens ({max_tokens})",
                           "min_tokens")
    return CommonParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k,
        seed=seed,
        ignore_eos=opt_bool(body, "ignore_eos"),
        min_tokens=min_tokens,
        stops=stop_list(body.get(stop_key), stop_key),
    )
