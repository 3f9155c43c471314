"""Our engine behind the proxy: an `EngineClient` that speaks `/ft/v1/generate`, and the
per-request wrapper that adds what the proxy knows.

The proxy renders the chat template itself (the server's own Anthropic/OpenAI routes run inside
the proxy over `TurnEngine`), so it holds the token ids and anchors of every prompt. `TurnEngine`
marks the adapter's predicted cut points on the anchors, adds a `system_block` anchor at each of
the adapter's head breaks (`heads.py`), sets the proxy's session key, computes
the edit point against the session's previous prompt, sends the native request and records
prompt / cached tokens, TTFT and decode rate from the event stream. A reply stopped by the
proxy's output cap (below what the client asked for) is reported as a normal end of turn: the
client's own limit was not reached, and Claude Code turns a `max_tokens` stop into an error.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from freetoken.log import get_logger, kv
from freetoken.proxy.heads import HeadBreaks
from freetoken.proxy.metrics import RequestRecord
from freetoken.proxy.sessions import SessionStore
from freetoken.server.errors import APIError
from freetoken.types.api import AdmissionError, Anchor, EngineEvent, GenerateRequest
from harness_adapters.base import HarnessAdapter

log = get_logger("proxy")


class NativeEngine:
    """`EngineClient` over HTTP: `generate()` streams `/ft/v1/generate`; closing the iterator
    closes the connection, which aborts the request in the engine."""

    def __init__(self, base_url: str, client: httpx.AsyncClient, model_name: str,
                 max_context: int, headers: dict[str, str] | None = None,
                 idle_s: float | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = client
        self.model_name = model_name
        self.max_context = max_context
        self.headers = headers or {}
        self.max_output_tokens: int | None = None
        # seconds without a byte from the engine's stream before it counts as hung: its
        # stream carries a keep-alive comment every KEEPALIVE_S (5 s) while it prefills, so
        # only a stopped or unreachable engine stays silent this long (None: no limit)
        self.idle_s = idle_s

    @classmethod
    async def connect(cls, base_url: str, client: httpx.AsyncClient,
                      headers: dict[str, str] | None = None,
                      idle_s: float | None = None) -> NativeEngine:
        r = await client.get(base_url.rstrip("/") + "/health", headers=headers or {})
        r.raise_for_status()
        h = r.json()
        return cls(base_url, client, str(h["model"]), int(h["max_context"]), headers, idle_s)

    def check(self, req: GenerateRequest) -> None:
        """The engine checks admission itself; its 400 arrives from `generate()`."""

    def stats(self) -> dict:
        return {}

    def generate(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        return self._gen(req)

    async def start(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        """Open the engine's stream; its admission error (a 4xx the engine answers before any
        event) raises here, before the client's response starts. Returns the event stream."""
        timeout = (httpx.Timeout(None, connect=self.client.timeout.connect, read=self.idle_s)
                   if self.idle_s else httpx.USE_CLIENT_DEFAULT)
        try:
            r = await self.client.send(self.client.build_request(
                "POST", self.base_url + "/ft/v1/generate", json=self._body(req),
                headers=self.headers, timeout=timeout), stream=True)
        except httpx.ReadTimeout:
            raise self._silent() from None
        try:
            if r.status_code >= 400:
                await self._raise_for(r)
        except BaseException:
            await r.aclose()
            raise
        return self._events(r)

    @staticmethod
    def _body(req: GenerateRequest) -> dict:
        sp = req.sampling
        return {"input_ids": req.input_ids, "session_key": req.session_key,
                "parent_key": req.parent_key,
                "anchors": [{"position": a.position, "kind": a.kind, "role": a.role,
                             "cut_point": a.cut_point} for a in req.anchors],
                "sampling": {"max_tokens": sp.max_tokens, "temperature": sp.temperature,
                             "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.seed,
                             "stop_token_ids": sp.stop_token_ids, "ignore_eos": sp.ignore_eos,
                             "min_tokens": sp.min_tokens}}

    @staticmethod
    async def _raise_for(r: httpx.Response) -> None:
        raw = await r.aread()
        try:
            err = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            err = {"message": raw.decode(errors="replace")[:500]}
        if r.status_code in (401, 403):  # the proxy's configuration, not the client
            raise APIError(502, f"the engine refused the proxy's key ({err.get('message')})"
                           "; start the proxy with --upstream-api-key", None, "upstream_auth")
        if r.status_code < 500:
            raise AdmissionError(str(err.get("message")), err.get("param"),
                                 str(err.get("code") or "invalid_request"))
        raise APIError(502, f"engine error {r.status_code}: {err.get('message')}", None,
                       "upstream_error")

    def _silent(self) -> APIError:
        log.warning(kv("engine_silent", engine=self.base_url, idle_s=self.idle_s))
        return APIError(504, f"the engine at {self.base_url} sent nothing for {self.idle_s:g} s "
                        "(not even a keep-alive): it is stopped or unreachable", None,
                        "upstream_timeout")

    async def _events(self, r: httpx.Response) -> AsyncIterator[EngineEvent]:
        try:
            async for line in self._lines(r):
                if not line.startswith("data: "):
                    continue  # keep-alive comments, event names
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise APIError(502, f"engine error: {ev['error'].get('message')}", None,
                                   "upstream_error")
                yield EngineEvent(list(ev["token_ids"]), bool(ev["finished"]),
                                  ev.get("finish_reason"), int(ev.get("prompt_tokens") or 0),
                                  int(ev.get("cached_tokens") or 0), ev.get("matched_stop_id"))
                if ev["finished"]:
                    return
        finally:
            await r.aclose()

    async def _lines(self, r: httpx.Response) -> AsyncIterator[str]:
        try:
            async for line in r.aiter_lines():
                yield line
        except httpx.ReadTimeout:
            raise self._silent() from None

    async def _gen(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        async for ev in await self.start(req):
            yield ev


@dataclass
class Turn:
    """What the proxy knows about one request before the engine sees it."""

    adapter: HarnessAdapter
    session: str
    messages: list[dict[str, Any]]
    record: RequestRecord
    cap: int | None  # the proxy's output cap when it is below what the client asked for
    system: str = ""  # the leading system text, as rendered
    breaks: list[int] = field(default_factory=list)  # adapter.head_breaks: offsets into system
    parent: str | None = None  # adapter.parent_key: a sub-agent's parent session
    user: str = ""  # the first user message's text, as rendered
    user_breaks: list[int] = field(default_factory=list)  # adapter.user_breaks: into `user`


class TurnEngine:
    """One request's view of the engine (see the module docstring)."""

    def __init__(self, inner: NativeEngine, turn: Turn, sessions: SessionStore,
                 on_done: Callable[[RequestRecord], None], heads: HeadBreaks | None = None
                 ) -> None:
        self.inner, self.turn, self.sessions, self.on_done = inner, turn, sessions, on_done
        self.heads = heads
        self.model_name = inner.model_name
        self.max_context = inner.max_context
        self.max_output_tokens = None

    def check(self, req: GenerateRequest) -> None:
        self.inner.check(req)

    def stats(self) -> dict:
        return self.inner.stats()

    async def start(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        """As `generate`, with the engine's admission answered before the stream starts."""
        self._annotate(req)
        try:
            stream = await self.inner.start(req)
        except AdmissionError as e:
            self.turn.record.status, self.turn.record.error = 400, e.message
            self.turn.record.duration_ms = round((time.time() - self.turn.record.t_start)
                                                 * 1000, 2)
            self.on_done(self.turn.record)
            raise
        return self._gen(req, stream)

    def generate(self, req: GenerateRequest) -> AsyncIterator[EngineEvent]:
        self._annotate(req)
        return self._gen(req, None)

    def _annotate(self, req: GenerateRequest) -> None:
        t = self.turn
        cuts = set(t.adapter.cut_points(req.anchors, t.messages))
        req.anchors = [Anchor(a.position, a.kind, a.role, a.cut_point or a.position in cuts)
                       for a in req.anchors]
        if self.heads is not None and t.breaks:
            req.anchors = self.heads.anchors(req.anchors, t.system, t.breaks, req.input_ids)
        if self.heads is not None and t.user_breaks:
            req.anchors = self.heads.anchors(req.anchors, t.user, t.user_breaks,
                                             req.input_ids)
        req.session_key, req.parent_key = t.session, t.parent
        ep = self.sessions.observe_tokens(t.session, req.input_ids, req.anchors, sorted(cuts))
        rec = t.record
        rec.predicted_cuts = sorted(cuts)
        rec.edit_kind, rec.edit_unit, rec.edit_position = ep.kind, ep.unit, ep.position
        rec.edit_block, rec.predicted_hit = ep.block, ep.predicted_hit
        rec.max_tokens_sent = req.sampling.max_tokens

    async def _gen(self, req: GenerateRequest, stream: AsyncIterator[EngineEvent] | None
                   ) -> AsyncIterator[EngineEvent]:
        rec = self.turn.record
        t0 = rec.t_start
        t_first: float | None = None
        try:
            async for ev in (stream if stream is not None else self.inner.generate(req)):
                now = time.time()
                if t_first is None:
                    t_first = now
                    rec.ttft_ms = round((now - t0) * 1000, 2)
                    rec.prompt_tokens, rec.cached_tokens = ev.prompt_tokens, ev.cached_tokens
                rec.output_tokens += len(ev.token_ids)
                if ev.finished:
                    rec.finish = ev.finish_reason
                    if (ev.finish_reason == "length" and self.turn.cap is not None
                            and rec.output_tokens >= self.turn.cap):
                        rec.capped = True
                        rec.finish = "cap"
                        log.info(kv("output_cap", request=rec.request_id, cap=self.turn.cap,
                                     requested=rec.max_tokens_requested))
                        ev = EngineEvent(ev.token_ids, True, "stop", ev.prompt_tokens,
                                         ev.cached_tokens, None)
                    if t_first is not None and rec.output_tokens > 1 and now > t_first:
                        rec.decode_tok_s = round((rec.output_tokens - 1) / (now - t_first), 2)
                yield ev
        except AdmissionError as e:
            rec.status, rec.error = 400, e.message
            raise
        except GeneratorExit:  # closed early; after the final event that is no disconnect
            rec.disconnected = rec.finish is None
            raise
        finally:
            rec.duration_ms = round((time.time() - t0) * 1000, 2)
            if rec.finish is None and rec.error is None:
                rec.disconnected = True
            self.on_done(rec)
