"""The three front doors the reliability batteries run against, in one process, over one tiny
real engine (the e2e suite's random qwen3_5_moe with the real Qwen3 tokenizer):

- S: the `ft serve` app (`create_app`) behind `uvicorn_config` (the guarded protocol);
- N: `ft agent-proxy` with its in-process engine (`start_engine_server`: the engine's app on a
  private Unix socket with a random key) in front of the same engine;
- U: `ft agent-proxy --upstream S`.

Every front has an API key (KEY) and the short `LIMITS`, so slow-client batteries finish fast.
`fault_app` is a scripted upstream (hung, slow, truncated, malformed, non-SSE; OpenAI's
`/v1/chat/completions` and Anthropic's `/v1/messages`) for U's
upstream-fault battery and the soak's U* front; `warm_pools` makes the engine's preallocated
pools resident before a soak measures RSS, `upstream_pool` reads a proxy's upstream
connections. Used by tests/reliability and scripts/reliability.py / soak.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

ROOT = Path(__file__).resolve().parents[2]
KEY = "reliability-key"


def limits(**kw: Any) -> Any:
    from freetoken.server.limits import ServerLimits

    base = dict(header_timeout_s=1.0, body_timeout_s=2.0, max_body_bytes=2 << 20,  # noqa: C408
                max_connections=96, max_connections_per_client=80, stall_timeout_s=2.0)
    return ServerLimits(**{**base, **kw})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """An ASGI app on a loopback port with the guarded protocol, in a daemon thread."""

    def __init__(self, app: Any, lim: Any) -> None:
        from freetoken.server.limits import uvicorn_config

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.limits = lim
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, lim))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 20:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@dataclass
class Front:
    name: str  # S, N or U
    url: str
    limits: Any
    served: Served
    key: str = KEY

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


class RecordingEngine:
    """The engine, with the prompt of every request it was asked to run kept (forgery checks)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.prompts: list[list[int]] = []  # the last 64
        self.count = 0  # requests seen in all

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _keep(self, req: Any) -> None:
        self.prompts.append(list(req.input_ids))
        del self.prompts[:-64]
        self.count += 1

    async def start(self, req: Any) -> Any:
        self._keep(req)
        return await self.inner.start(req)

    def generate(self, req: Any) -> Any:
        self._keep(req)
        return self.inner.generate(req)


def _tiny_builder() -> Any:
    spec = importlib.util.spec_from_file_location("_e2e_tiny", ROOT / "tests/e2e/conftest.py")
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(ROOT / "tests/server"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tiny_chat_model


@dataclass
class Stack:
    fronts: dict[str, Front]
    engine: RecordingEngine
    tok: Any
    closers: list[Any] = field(default_factory=list)
    # threads alive before the stack's own started: they allocate in malloc arenas of their
    # own that the one-arena cap cannot reach, so the process's RSS is not the stack's
    foreign_threads: int = 0

    def stop(self) -> None:
        for c in reversed(self.closers):
            c()


def start_stack(model_dir: Path, max_output: int = 4, **limit_kw: Any) -> Stack:
    """S, N and U over one engine on `model_dir` (built by `build_tiny(model_dir)`);
    `limit_kw` overrides the short `limits` (the soak keeps uvicorn's usual timeouts)."""
    import torch

    from freetoken.chat import ChatTokenizer
    from freetoken.cli.proxy import engine_client, start_engine_server
    from freetoken.engine.async_engine import AsyncEngine
    from freetoken.engine.core import EngineCore
    from freetoken.models.loader import load_model
    from freetoken.proxy.app import create_proxy_app
    from freetoken.proxy.config import ProxyConfig
    from freetoken.server import create_app
    from freetoken.server.limits import quiet_connection_logs

    quiet_connection_logs()
    foreign = threading.active_count() - 1
    cap_malloc_arenas()  # (before any front's thread starts)
    model = load_model(model_dir, dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(model_dir)
    core = EngineCore(model, tok.eos_token_ids, kv_tokens=65536, state_slots=24, max_running=4,
                      chunk_tokens=1024, max_context=65536)
    warm_pools(core)
    inner = AsyncEngine(core, model_dir, "tiny")
    inner.max_output_tokens = max_output  # every reply is short: the batteries test the door
    engine = RecordingEngine(inner)
    stack = Stack({}, engine, tok, [inner.shutdown], foreign_threads=foreign)
    lim = limits(**limit_kw)
    s = Served(create_app(engine, tok, api_key=KEY, served_model_names=["tiny"],
                          parser_family="qwen3_5_moe", limits=lim), lim)
    stack.closers.append(s.stop)
    stack.fronts["S"] = Front("S", s.url, lim, s)
    link, _, fam = start_engine_server(argparse.Namespace(stall_timeout=2.0), engine, tok,
                                       "qwen3_5_moe")
    stack.closers.append(link.stop)
    cfg = ProxyConfig(native_url=link.url, upstream_api_key=link.key, api_key=KEY,
                      metrics_path=None)
    n = Served(create_proxy_app(cfg, tok, fam, client=engine_client(cfg, link), limits=lim), lim)
    stack.closers.append(n.stop)
    stack.fronts["N"] = Front("N", n.url, lim, n)
    ucfg = ProxyConfig(upstream=s.url, upstream_api_key=KEY, api_key=KEY, metrics_path=None,
                       first_byte_timeout_s=20, idle_timeout_s=10, total_timeout_s=60)
    ulim = limits(**{"max_body_bytes": 4 << 20, **limit_kw})
    u = Served(create_proxy_app(ucfg, tok, fam, limits=ulim), ulim)
    stack.closers.append(u.stop)
    stack.fronts["U"] = Front("U", u.url, u.limits, u)
    return stack


def cap_malloc_arenas(n: int = 1) -> bool:
    """Make `ft`'s malloc settings (freetoken/cli/malloc.py: the fixed mmap threshold, or
    glibc's own variable when set) with at most `n` arenas for the threads started from here
    on; whether mallopt took the cap.

    This process runs every front (six servers' threads, the engine's, the workers'), and
    glibc gives each allocating thread an arena of its own (up to 8 per core) that keeps its
    freed memory for that thread: RSS then climbs for minutes with nothing retained (the CI
    soak's engine front grew ~9 MB per 10 s under default arenas, still 8-16 MB per CI soak
    under two, 0.0-0.4 under one; the tensors alive stayed at 112.6 MB throughout). The soak
    measures retention, so it takes one; a no-op where mallopt is missing (not glibc)."""
    import os

    from freetoken.cli import malloc
    from freetoken.envs import FT_MALLOC_ARENA_MAX

    made = malloc.apply({**os.environ, FT_MALLOC_ARENA_MAX.name: str(n)})
    return any(s.field == "arena_max" and s.applied for s in made)


def warm_pools(core: Any) -> None:
    """Touch every page of the engine's preallocated pools (KV, device state, kept logits,
    host state tier). A CPU tensor from `torch.zeros`/`empty` is backed lazily, page by page
    as it is first written, so a pool filling up over a soak reads as RSS growth (the tiny
    engine's pools are ~40 MB: 16 MB of KV, 14.5 MB of kept logits rows, the host tier)."""
    import torch

    for t in core.caches.kv.k + core.caches.kv.v:
        t.zero_()
    st = core.caches.state
    if st is not None:
        for t in st.conv + st.ssm:
            t.zero_()
    ek = core.eager  # (the kept rows are made by the first row kept, as float32 here)
    if ek.n_kept and ek.kept is None:
        ek.kept = torch.zeros((ek.n_kept, core.cfg.vocab_size), dtype=torch.float32)
    host = core.cache_ops.host
    if host is not None:
        for c in range(-(-host.num_slots // host.chunk_slots)):
            host._chunk(c, on_demand=True).zero_()


def upstream_pool(front: Any) -> dict[str, int]:
    """A proxy front's upstream connections by state (httpcore's `ACTIVE`: a request or
    response holds it; `IDLE`: pooled for reuse); {} for `ft serve` or before any request.
    A connection left `ACTIVE` with nothing in flight is leaked: its socket stays open."""
    ps = getattr(getattr(front.served.app, "app", None), "state", None)
    client = getattr(getattr(ps, "proxy", None), "_client", None)
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    out: dict[str, int] = {}
    for c in pool.connections if pool is not None else []:
        state = c.info().split(", ")[-2] if "HTTP/1.1" in c.info() else "CONNECTING"
        out[state] = out.get(state, 0) + 1
    return out


def build_tiny(out: Path) -> Path:
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        _tiny_builder()(out)
    return out


# ---- a scripted faulty upstream -----------------------------------------------------------

FAULTS = ("hang", "hang_mid", "truncated", "malformed", "not_sse", "status_413", "refused")
SLOW_S = 2.0  # the `slow` upstream's wait before its (normal) answer


def fault_app(mode: dict[str, str]) -> Any:
    """An OpenAI 'upstream' whose behaviour is `mode['now']` (one of FAULTS, `ok`, or `drip`: a
    stream that sends a chunk every 0.2 s for ever; `gush`: 4 KB chunks as fast as they go),
    or for
    one request the mode its model names (`"model": "fault:slow"`); `slow` answers normally
    after SLOW_S (a proxy whose first-byte timeout is shorter gives up first)."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def oa(delta: dict, finish: str | None = None) -> str:
        return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                      "created": 1, "model": "up", "choices": [
                                          {"index": 0, "delta": delta,
                                           "finish_reason": finish}]}) + "\n\n"

    async def chat(request: Request) -> Response:
        body = await request.json()
        named = str(body.get("model", ""))
        m = named[6:] if named.startswith("fault:") else mode["now"]
        if m == "slow":
            await asyncio.sleep(SLOW_S)
        if m == "status_413":
            return JSONResponse({"error": {"message": "too big", "type": "invalid_request_error",
                                           "param": None, "code": "body_too_large"}}, 413)
        if m == "hang":
            await asyncio.sleep(3600)
        if not body.get("stream"):
            if m == "not_sse":
                return Response("<html>gateway</html>", 200, media_type="text/html")
            if m == "hang_mid":
                await asyncio.sleep(3600)
            if m in ("truncated", "malformed"):
                return Response('{"id": "c", "choices": [{"index"', 200,
                                media_type="application/json")
            return JSONResponse({"id": "c", "object": "chat.completion", "created": 1,
                                 "model": "up", "choices": [{"index": 0, "message": {
                                     "role": "assistant", "content": "ok"},
                                     "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                           "total_tokens": 4}})

        async def gen():
            yield oa({"role": "assistant", "content": ""})
            yield oa({"content": "half an"})
            while m == "drip":  # alive, never idle, never done: only the total timeout ends it
                await asyncio.sleep(0.2)
                yield oa({"content": " more"})
            while m == "gush":  # a long reply as fast as it goes (for clients that stop reading)
                await asyncio.sleep(0.01)
                yield oa({"content": "x" * 4000})
            if m == "hang_mid":
                await asyncio.sleep(3600)
            if m == "malformed":
                yield 'data: {"choices": [{"index": 0, "delta": {"content": "x"\n\n'
                return
            if m == "truncated":
                return
            yield oa({"content": " answer"})
            yield oa({}, "stop")
            yield "data: [DONE]\n\n"

        if m == "not_sse":
            return StreamingResponse(gen(), media_type="text/plain")
        return StreamingResponse(gen(), media_type="text/event-stream")

    def an(kind: str, **v: Any) -> str:
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, **v}) + "\n\n"

    async def messages(request: Request) -> Response:
        """The same faults as an Anthropic upstream (its event stream and shapes)."""
        body = await request.json()
        m = mode["now"]
        if m == "status_413":
            return JSONResponse({"type": "error", "error": {"type": "request_too_large",
                                                            "message": "too big"}}, 413)
        if m == "hang":
            await asyncio.sleep(3600)
        if not body.get("stream"):
            if m == "not_sse":
                return Response("<html>gateway</html>", 200, media_type="text/html")
            if m == "hang_mid":
                await asyncio.sleep(3600)
            if m in ("truncated", "malformed"):
                return Response('{"id": "msg_1", "content": [{"type"', 200,
                                media_type="application/json")
            return JSONResponse({"id": "msg_1", "type": "message", "role": "assistant",
                                 "model": "up", "content": [{"type": "text", "text": "ok"}],
                                 "stop_reason": "end_turn", "stop_sequence": None,
                                 "usage": {"input_tokens": 3, "output_tokens": 1}})

        async def gen():
            yield an("message_start", message={
                "id": "msg_1", "type": "message", "role": "assistant", "model": "up",
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 3, "output_tokens": 0}})
            yield an("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield an("content_block_delta", index=0, delta={"type": "text_delta",
                                                             "text": "half an"})
            if m == "hang_mid":
                await asyncio.sleep(3600)
            if m == "malformed":
                yield 'event: content_block_delta\ndata: {"type": "content_block_delta", "in\n\n'
                return
            if m == "truncated":
                return
            yield an("content_block_stop", index=0)
            yield an("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                     usage={"output_tokens": 2})
            yield an("message_stop")

        if m == "not_sse":
            return StreamingResponse(gen(), media_type="text/plain")
        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/messages", messages, methods=["POST"])])


def start_fault_proxy(tok: Any, front_limits: Any = None, api: str = "openai",
                      **timeouts: float) -> tuple[Front, dict[str, str], Served]:
    """U in front of the scripted upstream, as an OpenAI (`api`; the other API's clients are
    translated) or an Anthropic server; `front_limits`: the proxy's (default: the short
    `limits()`)."""
    from freetoken.proxy.app import create_proxy_app
    from freetoken.proxy.config import ProxyConfig
    from freetoken.server.limits import ServerLimits

    mode = {"now": "truncated"}
    up = Served(fault_app(mode), ServerLimits(header_timeout_s=10))
    cfg = ProxyConfig(upstream=up.url, upstream_api=api, api_key=KEY, metrics_path=None,
                      ping_s=0.5, **timeouts)
    lim = front_limits or limits()
    p = Served(create_proxy_app(cfg, tok, "qwen3"), lim)
    return Front("U*", p.url, lim, p), mode, up
