"""The proxy's shared state: configuration, the upstream/engine clients, sessions, metrics."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
from starlette.requests import Request

from freetoken.log import get_logger, kv
from freetoken.proxy import jsonc
from freetoken.proxy.config import ProxyConfig
from freetoken.proxy.heads import HeadBreaks
from freetoken.proxy.metrics import Metrics
from freetoken.proxy.native import NativeEngine
from freetoken.proxy.probe import UpstreamInfo, context_from_error, probe
from freetoken.proxy.sessions import SessionStore
from freetoken.proxy.upstream import Upstream
from freetoken.server.errors import APIError
from freetoken.server.guard import replaying
from freetoken.server.state import ServerState

log = get_logger("proxy")


def template_rejects_mid_system(tokenizer: Any) -> bool:
    """True when the chat template cannot render a system message after the first turn."""
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "system", "content": "c"}, {"role": "user", "content": "d"}]
    try:
        tokenizer.render(msgs)
        return False
    except Exception:  # noqa: BLE001 - any refusal of the template means "fold"
        return True


class ProxyState:
    def __init__(self, cfg: ProxyConfig, tokenizer: Any = None, parser_family: str = "qwen3",
                 client: httpx.AsyncClient | None = None) -> None:
        self.cfg, self.tokenizer, self.parser_family = cfg, tokenizer, parser_family
        self._client = client
        self.metrics = Metrics(cfg.metrics_path, max_sessions=cfg.max_sessions,
                               session_idle_s=cfg.session_idle_s)
        self.sessions = SessionStore()
        self.heads = HeadBreaks(tokenizer) if tokenizer is not None else None
        self._native: NativeEngine | None = None
        self._lock: asyncio.Lock | None = None
        self.info: UpstreamInfo | None = None  # API mode: what the upstream serves (probe.py)
        self._probe_lock: asyncio.Lock | None = None
        fold = cfg.fold_system
        self.fold_system = fold == "fold" or (fold == "auto" and tokenizer is not None
                                              and template_rejects_mid_system(tokenizer))

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # created in the serving loop; no pool limit: never serialise
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=self.cfg.connect_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._client

    def upstream(self) -> Upstream:
        assert self.cfg.upstream is not None
        c = self.cfg
        api = c.upstream_api
        if api == "both" and self.info is not None:  # translate to what it really serves
            has = self.info.surfaces
            if not has.get("anthropic", True):
                api = "openai"
            elif not has.get("openai", True):
                api = "anthropic"
        return Upstream(c.upstream, api, self.client, c.upstream_api_key, c.ping_s,
                        forward_client_key=c.api_key is None,
                        first_byte_s=c.first_byte_timeout_s, idle_s=c.idle_timeout_s,
                        total_s=c.total_timeout_s)

    def _probe_headers(self) -> dict[str, str]:
        key = self.cfg.upstream_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def probed(self) -> UpstreamInfo | None:
        """API mode: the upstream's surfaces and limits, asked once (at start, `probe_at_start`;
        else, or if the upstream did not answer then, at the first request)."""
        if self.cfg.upstream is None or self.info is not None or self.cfg.upstream_api != "both":
            return self.info
        self._probe_lock = self._probe_lock or asyncio.Lock()
        async with self._probe_lock:
            if self.info is None:
                self.info = await probe(self.client, self.cfg.upstream, self._probe_headers())
        return self.info

    def probe_at_start(self, timeout_s: float = 2.0) -> UpstreamInfo | None:
        """API mode, before serving (`ft agent-proxy --upstream`): the probe now, on a client
        of its own, so the first client (and `ft launch`, which reads the proxy's /v1/models)
        meets the upstream's surfaces and limits. An upstream that answers nothing yet (started
        after the proxy) is probed again at the first request."""
        if self.cfg.upstream is None or self.cfg.upstream_api != "both":
            return None

        async def ask() -> UpstreamInfo:
            async with httpx.AsyncClient() as c:
                return await probe(c, self.cfg.upstream, self._probe_headers(), timeout_s)

        info = asyncio.run(ask())
        if info.surfaces or info.context is not None:
            self.info = info
        else:
            log.info(kv("upstream_probe_deferred", upstream=self.cfg.upstream,
                        reason="no answer at start", next="the first request"))
        return self.info

    def learn(self, rec: Any) -> None:
        """API mode, after each request: an upstream whose probe found no context but whose
        error states it ("maximum context length is N tokens") has that context from now on
        (`/proxy/stats` `upstream_limits`, read by `ft launch`)."""
        if self.info is None or self.info.context is not None or rec.status != 400:
            return
        n = context_from_error(rec.error)
        if n is not None:
            self.info.context = n
            log.info(kv("upstream_limit_learned", upstream=self.cfg.upstream, context=n,
                        source="context_error", request=rec.request_id))

    def record(self, rec: Any) -> None:
        """The metrics record of a finished request, and what it says about the upstream."""
        self.learn(rec)
        self.metrics.record(rec)

    async def native(self) -> NativeEngine:
        if self._native is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._native is None:
                    assert self.cfg.native_url is not None
                    try:
                        key = self.cfg.upstream_api_key  # an `ft serve --api-key` engine
                        auth = {"authorization": f"Bearer {key}"} if key else None
                        self._native = await NativeEngine.connect(
                            self.cfg.native_url, self.client, auth,
                            idle_s=self.cfg.idle_timeout_s)
                    except httpx.HTTPError as e:
                        raise APIError(502, f"engine unreachable at {self.cfg.native_url}: "
                                       f"{e!r}", None, "upstream_error") from None
        return self._native


def inner_request(request: Request, body: dict, st: ServerState) -> Request:
    """The same request with the normalised body and an app whose state is `st`."""
    scope = dict(request.scope)
    scope["app"] = SimpleNamespace(state=SimpleNamespace(ft=st))
    return Request(scope, replaying(jsonc.dumps(body), request.receive))
