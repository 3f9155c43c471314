"""What an upstream serves, asked once at proxy start (`probe`): which API surfaces it has
(`/v1/chat/completions`, `/v1/messages`, `/v1/responses`) and its context and output limits,
read from whichever dialect the engine speaks:

- OpenAI-style `/v1/models` entries with `context_length` (ft serve, SGLang, OpenRouter-likes),
  `max_model_len` (vLLM), `max_context_length`, `meta.n_ctx` / `meta.n_ctx_train` (llama.cpp's
  llama-server), `max_output_tokens` / `max_completion_tokens` where given;
- llama.cpp's `/props`: `default_generation_settings.n_ctx` (the slot context actually
  configured, which beats the training context) and `n_predict` when positive.

An engine whose endpoints report no context (llama-cpp-python's server: its `/v1/models` names
the model only) still says it when a prompt does not fit: the OpenAI-style 400 "This model's
maximum context length is N tokens" (OpenAI, vLLM, llama-cpp-python) or llama-cpp-python's
"exceed context window of N". `context_from_error` reads N, and the proxy keeps it as the
upstream's context from then on (`ProxyState.learn`), so a later `ft launch` writes it.

`/v1/messages` counts as present when a POST of `{}` is answered with anything but 404/405 (a
400 or 422 for the empty body is the route refusing it; nothing is generated); unreachable, it
stays unknown and `--upstream-api` decides. `/v1/chat/completions` is assumed (every engine
has it) and `/v1/responses` is always translated to it by the proxy. Used by the proxy
to translate where a surface is missing instead of forwarding into a 404, and by `ft launch`
(through `/proxy/stats` `upstream_limits`) to tell the harness the real limits.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from freetoken.log import get_logger, kv

log = get_logger("proxy")
# probed: the chat surface is what every engine has; /v1/responses is always translated
SURFACES = {"anthropic": "/v1/messages"}
_CTX_KEYS = ("context_length", "max_model_len", "max_context_length", "context_window")
_OUT_KEYS = ("max_output_tokens", "max_completion_tokens")


@dataclass
class UpstreamInfo:
    surfaces: dict[str, bool] = field(default_factory=dict)
    context: int | None = None
    max_output: int | None = None
    model: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def limits_from_models(body: dict) -> tuple[int | None, int | None, str | None]:
    """(context, max output, model id) of the first model of a `/v1/models` answer."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None, None, None
    m = data[0]
    meta = m.get("meta") if isinstance(m.get("meta"), dict) else {}
    ctx = next((v for k in _CTX_KEYS if (v := _int(m.get(k)))), None)
    ctx = ctx or _int(meta.get("n_ctx")) or _int(meta.get("n_ctx_train"))
    out = next((v for k in _OUT_KEYS if (v := _int(m.get(k)))), None)
    top = m.get("top_provider") if isinstance(m.get("top_provider"), dict) else {}
    out = out or _int(top.get("max_completion_tokens"))
    name = m.get("id") if isinstance(m.get("id"), str) else None
    return ctx, out, name


def limits_from_props(body: Any) -> tuple[int | None, int | None]:
    """(context, max output) from llama.cpp's `/props`."""
    if not isinstance(body, dict):
        return None, None
    gs = body.get("default_generation_settings")
    gs = gs if isinstance(gs, dict) else {}
    params = gs.get("params") if isinstance(gs.get("params"), dict) else {}
    ctx = _int(gs.get("n_ctx")) or _int(body.get("n_ctx"))
    return ctx, _int(params.get("n_predict")) or _int(gs.get("n_predict"))


_CTX_ERR = re.compile(r"maximum context length is (\d+) tokens|context window of (\d+)")


def context_from_error(message: str | None) -> int | None:
    """The context an upstream's "prompt too long" error states, else None."""
    m = _CTX_ERR.search(message or "")
    return _int(int(m.group(1) or m.group(2))) if m else None


async def _ask(what: str, call: Any) -> httpx.Response | None:
    try:
        return await call
    except Exception as e:  # noqa: BLE001 - unreachable or odd: that answer stays unknown
        log.debug(kv("upstream_probe_failed", what=what, reason=repr(e)[:200]))
        return None


def _json(r: httpx.Response | None) -> Any:
    try:
        return r.json() if r is not None and r.status_code == 200 else None
    except ValueError:
        return None


async def probe(client: httpx.AsyncClient, base_url: str, headers: dict[str, str],
                timeout_s: float = 5.0) -> UpstreamInfo:
    """Ask the upstream what it serves; anything unreachable stays unknown (None / absent)."""
    base = base_url.rstrip("/")
    info = UpstreamInfo()
    for name, path in SURFACES.items():
        r = await _ask(path, client.post(base + path, content=b"{}", timeout=timeout_s,
                                         headers={**headers,
                                                  "content-type": "application/json"}))
        if r is not None:
            info.surfaces[name] = r.status_code not in (404, 405)
    models = _json(await _ask("/v1/models", client.get(base + "/v1/models", headers=headers,
                                                       timeout=timeout_s)))
    if isinstance(models, dict):
        info.context, info.max_output, info.model = limits_from_models(models)
    props = _json(await _ask("/props", client.get(base + "/props", headers=headers,
                                                  timeout=timeout_s)))
    ctx, out = limits_from_props(props)
    info.context = ctx or info.context  # llama.cpp's configured slot context beats n_ctx_train
    info.max_output = info.max_output or out
    log.info(kv("upstream_probe", upstream=base, surfaces=",".join(
        f"{k}={'yes' if v else 'no'}" for k, v in info.surfaces.items()), context=info.context,
        max_output=info.max_output, model=info.model))
    return info


def cached_from_openai(chunk: dict) -> int | None:
    """The cached prompt tokens an OpenAI-dialect upstream reports, in its own counters:
    `usage.prompt_tokens_details.cached_tokens` (OpenAI, vLLM, SGLang, ft serve), else
    llama.cpp's `timings.cache_n`; None when the upstream reports neither (unknown, not 0)."""
    u = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else {}
    det = u.get("prompt_tokens_details")
    if isinstance(det, dict) and isinstance(det.get("cached_tokens"), int):
        return int(det["cached_tokens"])
    t = chunk.get("timings")
    if isinstance(t, dict) and isinstance(t.get("cache_n"), int):
        return int(t["cache_n"])
    return None


def carries_token(api: str, event: str | None, data: str) -> bool:
    """Whether an upstream SSE event carries generated output (for TTFT): an Anthropic
    `content_block_delta`, or an OpenAI chunk with non-empty content, reasoning or tool calls
    (the role-only first chunk and usage chunks come before or without any token)."""
    if data == "[DONE]":
        return False
    if api == "anthropic":
        return event == "content_block_delta"
    import json

    try:
        v = json.loads(data)
    except ValueError:
        return False
    for ch in v.get("choices") or [] if isinstance(v, dict) else []:
        d = ch.get("delta") or {}
        if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get(
                "tool_calls"):
            return True
    return False
