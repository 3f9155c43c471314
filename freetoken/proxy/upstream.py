"""Forwarding to another OpenAI- or Anthropic-compatible server (vLLM, SGLang, llama.cpp, another
`ft serve`): the normalised request goes out on the surface the upstream speaks, translated when
it is not the client's.

Streams are relayed by `relay.StreamRelay` (as they arrive, with backpressure, keep-alives and
upstream cancellation on client disconnect). If the upstream answers an error before `ping_s`,
its status is passed on with the error in the client's API shape.

Auth: with `--upstream-api-key` that key is sent; else, when the proxy has no key of its own,
the client's `Authorization` / `x-api-key` go to the configured upstream (only there). A client
key that unlocked the proxy itself (`--api-key`) is the proxy's, never forwarded. Keys are never
logged or recorded.

Timeouts (`ProxyConfig`, flags `--upstream-*-timeout`): connect `connect_s`; the response head
and first body bytes of a stream within `first_byte_s`; between two chunks of a stream
`idle_s`; a whole request (streamed or not) `total_s`. Each ends the request with 504
`upstream_timeout` in the client's shape (in-band once a stream has started).
"""
from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from freetoken.log import get_logger
from freetoken.proxy import jsonc
from freetoken.proxy.translate_stream import json_or_none
from freetoken.server.errors import APIError

log = get_logger("proxy")
FINISH = re.compile(r'"(finish_reason|stop_reason)":\s*"')
# the harness's session and lineage headers too (#23: an `ft serve` upstream keys sessions and
# sub-agents by them, `server.generation.session_key_from` / `parent_key_from`)
_PASS_HEADERS = ("anthropic-version", "anthropic-beta", "user-agent", "x-session-id",
                 "x-session-affinity", "x-claude-code-session-id", "x-claude-code-agent-id",
                 "x-parent-session-id", "x-codex-turn-metadata")


@dataclass
class SSEEvent:
    event: str | None
    data: str
    raw: str  # the event as received, comment lines dropped, with its blank-line terminator


def parse_event(text: str) -> SSEEvent | None:
    """One SSE event (the text between two blank lines); None for a comment-only one."""
    event: str | None = None
    data: list[str] = []
    kept: list[str] = []
    for line in text.split("\n"):
        if not line or line.startswith(":"):
            continue
        kept.append(line)
        if line.startswith("data:"):
            data.append(line[6:] if line[5:6] == " " else line[5:])
        elif line.startswith("event:"):
            event = line[6:].strip()
    if not data:
        return None
    raw = text if len(kept) == text.count("\n") + 1 else "\n".join(kept)
    return SSEEvent(event, "\n".join(data), raw + "\n\n")


async def sse_batches(chunks: AsyncIterator[str]) -> AsyncIterator[list[SSEEvent]]:
    """The complete events of each upstream chunk, as they arrive (a partial event waits for
    the rest of it, nothing else waits)."""
    buf = ""
    async for text in chunks:
        buf += text.replace("\r\n", "\n") if "\r" in text else text
        if "\n\n" not in buf:
            continue
        *complete, buf = buf.split("\n\n")
        batch = [e for t in complete if t.strip() and (e := parse_event(t)) is not None]
        if batch:
            yield batch
    if buf.strip() and (e := parse_event(buf)) is not None:
        yield [e]


class Upstream:
    """`api`: 'openai', 'anthropic' or 'both' (what the upstream serves)."""

    def __init__(self, base_url: str, api: str, client: httpx.AsyncClient,
                 api_key: str | None = None, ping_s: float = 5.0, *,
                 forward_client_key: bool = True, first_byte_s: float = 300.0,
                 idle_s: float = 120.0, total_s: float = 1800.0) -> None:
        if api not in ("openai", "anthropic", "both"):
            raise ValueError(f"upstream api must be openai, anthropic or both, not {api!r}")
        self.base_url, self.api, self.client = base_url.rstrip("/"), api, client
        self.api_key, self.ping_s = api_key, ping_s
        self.forward_client_key = forward_client_key
        self.first_byte_s, self.idle_s, self.total_s = first_byte_s, idle_s, total_s

    def api_out(self, api_in: str) -> str:
        return api_in if self.api in ("both", api_in) else self.api

    def headers(self, incoming: Any, api_out: str) -> dict[str, Any]:
        # as received: HTTP header values are bytes (starlette decodes them as latin-1), and a
        # non-ASCII one must not fail the request when it is encoded again
        h: dict[str, Any] = {k: v.encode("latin-1") for k in _PASS_HEADERS
                             if (v := incoming.get(k))}
        h["content-type"] = "application/json"
        key = self.api_key
        if key is None and self.forward_client_key:
            auth = incoming.get("authorization") or ""
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else incoming.get("x-api-key")
        if key:
            if api_out == "anthropic":
                h["x-api-key"] = key.encode("latin-1", "replace")
            else:
                h["authorization"] = f"Bearer {key}".encode("latin-1", "replace")
        if api_out == "anthropic":
            h.setdefault("anthropic-version", "2023-06-01")
        return h

    def url(self, api_out: str, count_tokens: bool = False) -> str:
        if api_out == "anthropic":
            return self.base_url + ("/v1/messages/count_tokens" if count_tokens else "/v1/messages")
        return self.base_url + "/v1/chat/completions"

    async def open(self, url: str, body: dict, headers: dict[str, Any],
                   raw: bytes | None = None) -> httpx.Response:
        content = raw if raw is not None else jsonc.dumps(body)
        req = self.client.build_request("POST", _parsed(url), content=content, headers=headers)
        return await self.client.send(req, stream=True)


@functools.lru_cache(maxsize=64)
def _parsed(url: str) -> httpx.URL:
    """Parsed once per upstream URL, not per request."""
    return httpx.URL(url)


def error_from(status: int, raw: bytes) -> APIError:
    """An upstream error body (either shape) as an APIError with the upstream's status."""
    msg = raw.decode(errors="replace")[:1000]
    v = json_or_none(msg)
    if isinstance(v, dict) and isinstance(v.get("error"), dict):
        msg = str(v["error"].get("message") or msg)
    return APIError(status, f"upstream: {msg}", None, "upstream_error")
