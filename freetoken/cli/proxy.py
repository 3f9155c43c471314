"""`ft agent-proxy`: the proxy in front of our engine (in-process demo or `--model PATH`, or an
`ft serve` spoken to natively with `--native-url`) or in front of any OpenAI/Anthropic server
(`--upstream URL`)."""
from __future__ import annotations

import argparse
import os
import secrets
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.log import get_logger, kv

log = get_logger("proxy")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("agent-proxy", help="the agent proxy: Claude Code, OpenCode, "
                              "OpenClaw, mini-swe-agent in front of our engine or any other")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help="start our engine in-process on this checkpoint (default: demo)")
    src.add_argument("--upstream", default=None,
                     help="front this OpenAI/Anthropic-compatible server (vLLM, SGLang, "
                          "llama.cpp, ft serve) instead")
    src.add_argument("--native-url", default=None,
                     help="front a running `ft serve` through /ft/v1/generate (needs "
                          "--tokenizer, the served checkpoint's directory)")
    p.add_argument("--upstream-api", default="both", choices=("openai", "anthropic", "both"),
                   help="what --upstream serves; requests in the other API are translated")
    p.add_argument("--upstream-api-key", default=None,
                   help="key sent to the upstream instead of the client's (with "
                        "--native-url: the key of that `ft serve --api-key`); prefer "
                        "--upstream-api-key-file. Not the proxy's own key: see --api-key")
    p.add_argument("--upstream-api-key-file", default=None,
                   help="read --upstream-api-key from this file (first line)")
    p.add_argument("--upstream-connect-timeout", type=float, default=10.0,
                   help="seconds to connect to the upstream")
    p.add_argument("--upstream-first-byte-timeout", type=float, default=300.0,
                   help="seconds until a streamed upstream reply's first bytes")
    p.add_argument("--upstream-idle-timeout", type=float, default=120.0,
                   help="seconds a streamed upstream reply may send nothing (keep-alives "
                        "count)")
    p.add_argument("--upstream-total-timeout", type=float, default=1800.0,
                   help="seconds an upstream request may take in all (streamed or not)")
    p.add_argument("--tokenizer", default=None, help="checkpoint directory with the tokenizer "
                   "(native mode; API mode uses it only for count_tokens)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    from freetoken.server.front_options import add_front_door_args

    add_front_door_args(p, "proxy")  # the same front door as ft serve
    p.add_argument("--output-cap", action="append", default=None, metavar="N|HARNESS=N",
                   help="cap each reply at N tokens (repeatable, per harness); a reply stopped "
                        "by the cap ends as a normal turn. Default: 256 with the demo model, 8192 "
                        "with --upstream, none with --model PATH")
    p.add_argument("--step", action="append", default=None, metavar="NAME=on|off",
                   help="switch a normalisation step (see docs/proxy.md)")
    p.add_argument("--harness", default=None, help="force one adapter instead of detecting")
    p.add_argument("--fold-system", default="auto", choices=("auto", "keep", "fold"))
    p.add_argument("--metrics", default=None, metavar="FILE",
                   help="JSONL record per request (default "
                        "${XDG_CACHE_HOME:-~/.cache}/freetoken/proxy.jsonl)")
    p.add_argument("--ping-s", type=float, default=5.0, help="keep-alive interval of streams")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-running", type=int, default=4)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--kv-tokens", type=int, default=None)
    from freetoken.cli.options import add_cache_args, add_moe_args

    add_moe_args(p)
    add_cache_args(p)
    p.set_defaults(func=run_proxy)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EngineLink:
    """How the proxy reaches its in-process engine: `url` over the Unix socket `uds` (no TCP
    port), with `key`, a random key the engine's `Guard` requires."""

    url: str
    uds: str
    key: str
    server: Any = None
    engine: Any = None  # the in-process AsyncEngine it built (stopped with the link)
    thread: Any = None  # the engine server's thread

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine's server (its open streams end), then the engine after its current
        step and its threads (`AsyncEngine.shutdown`)."""
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
        if self.engine is not None and hasattr(self.engine, "shutdown"):
            self.engine.shutdown()


def start_engine_server(args: argparse.Namespace, engine: Any = None, tok: Any = None,
                        family: str | None = None) -> tuple[EngineLink, Any, str]:
    """Our engine and the `ft serve` app in a background thread, reachable only through a Unix
    socket in a private (0700) directory and with a random API key, behind the same `Guard`
    and protocol as every front door; returns (link, tokenizer, parser family). `engine`,
    `tok`, `family`: an engine already built (tests), else `build_engine(args)`."""
    import uvicorn

    from freetoken.chat import ChatTokenizer
    from freetoken.cli.build import build_engine
    from freetoken.cli.options import engine_config_from_args
    from freetoken.cli.serve import parser_family_for
    from freetoken.server.app import create_app
    from freetoken.server.limits import ServerLimits, protocol_for

    owned = engine is None  # an engine handed in stays its caller's to stop
    if owned:
        engine = build_engine(engine_config_from_args(args))
    tok = tok or getattr(engine, "tokenizer", None) or ChatTokenizer.from_dir(engine.model_dir)
    family = family or parser_family_for(engine.model_dir)
    key = secrets.token_urlsafe(32)
    limits = ServerLimits(stall_timeout_s=getattr(args, "stall_timeout", 30.0))
    app = create_app(engine, tok, api_key=key, served_model_names=[engine.model_name],
                     parser_family=family, limits=limits)
    uds = str(Path(tempfile.mkdtemp(prefix="ft-engine-")) / "engine.sock")  # mkdtemp: 0700
    server = uvicorn.Server(uvicorn.Config(app, uds=uds, log_level="warning", lifespan="off",
                                           http=protocol_for(limits), timeout_keep_alive=75))
    thread = threading.Thread(target=server.run, daemon=True, name="ft-engine-http")
    thread.start()
    t0 = time.time()
    while not server.started:
        if time.time() - t0 > 60:
            raise RuntimeError("the in-process engine server did not start")
        time.sleep(0.02)
    os.chmod(uds, 0o600)
    if hasattr(engine, "begin_warm_up"):  # the server is up: the idle warm-up may start
        engine.begin_warm_up()
    return EngineLink("http://localhost", uds, key, server,
                      engine if owned else None, thread), tok, family


def build_config(args: argparse.Namespace, native_url: str | None,
                 engine_key: str | None = None) -> Any:
    """`engine_key`: the in-process engine's random key (else --upstream-api-key[-file])."""
    from freetoken.proxy.config import (
        DEMO_OUTPUT_CAP,
        UPSTREAM_OUTPUT_CAP,
        ProxyConfig,
        parse_caps,
    )
    from freetoken.server.front_options import api_key_from, other_key
    from harness_adapters.normalise import parse_step_switches

    caps = parse_caps(args.output_cap)
    demo = (native_url is not None and args.native_url is None
            and (args.model or "demo") in ("demo", "demo-random"))
    if demo and "*" not in caps:
        caps["*"] = DEMO_OUTPUT_CAP
    elif args.upstream is not None and "*" not in caps:
        caps["*"] = UPSTREAM_OUTPUT_CAP
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    metrics = args.metrics or str(Path(cache) / "freetoken" / "proxy.jsonl")
    prog = "ft agent-proxy"
    up_key = engine_key or other_key(args.upstream_api_key, args.upstream_api_key_file,
                                     "--upstream-api-key", prog)
    return ProxyConfig(upstream=args.upstream, upstream_api=args.upstream_api,
                       upstream_api_key=up_key, native_url=native_url,
                       tokenizer_dir=args.tokenizer, caps=caps,
                       steps=parse_step_switches(args.step), metrics_path=metrics,
                       ping_s=args.ping_s, force_harness=args.harness,
                       fold_system=args.fold_system,
                       api_key=api_key_from(args, dict(os.environ), prog),
                       connect_timeout_s=args.upstream_connect_timeout,
                       first_byte_timeout_s=args.upstream_first_byte_timeout,
                       idle_timeout_s=args.upstream_idle_timeout,
                       total_timeout_s=args.upstream_total_timeout)


def banner(url: str, cfg: Any) -> str:
    mode = f"upstream {cfg.upstream}" if cfg.upstream else f"our engine ({cfg.native_url})"
    lines = [f"ft agent-proxy on {url} -> {mode}",
             (f"  output caps: {cfg.caps or 'none'}   stats: {url}/proxy/stats   "
             f"records: {cfg.metrics_path}"),
             "Point a harness at it (prints the env/config; --write DIR writes it):"]
    for h in ("claude", "opencode", "openclaw", "mini", "codex"):
        lines.append(f"  ft launch {h} --proxy {url}")
    lines.append(f"  e.g.  eval \"$(ft launch claude --proxy {url})\" && claude")
    return "\n".join(lines)


def run_proxy(args: argparse.Namespace) -> int:
    from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
    from freetoken.cli.serve import parser_family_for
    from freetoken.proxy.app import create_proxy_app
    from freetoken.server.front_options import limits_from
    from freetoken.server.lifecycle import serve_until_stopped
    from freetoken.server.limits import quiet_connection_logs, uvicorn_config

    tok, family = None, "qwen3"
    native_url, link = args.native_url, None
    if args.upstream is None and native_url is None:
        link, tok, family = start_engine_server(args)
        native_url = link.url
    elif native_url is not None:
        if not args.tokenizer:
            raise SystemExit("ft agent-proxy: --native-url needs --tokenizer DIR")
        tok, family = ChatTokenizer.from_dir(args.tokenizer), parser_family_for(args.tokenizer)
    else:
        tok = ChatTokenizer.from_dir(args.tokenizer or qwen3_tokenizer_dir())
    cfg = build_config(args, native_url, link.key if link else None)
    limits = limits_from(args)
    app = create_proxy_app(cfg, tok, family, client=engine_client(cfg, link), limits=limits)
    app.app.state.proxy.probe_at_start()  # (the Guard wraps the proxy's app)
    url = f"http://{args.host}:{args.port}"
    print(banner(url, cfg), flush=True)
    if cfg.upstream_api_key and not cfg.api_key:
        log.warning(kv("proxy_without_key", note="the proxy sends --upstream-api-key for any "
                       "caller that reaches it; give it its own key (--api-key-file)"))
    log.info(kv("agent_proxy", host=args.host, port=args.port, native=cfg.native,
                auth=bool(cfg.api_key)))
    quiet_connection_logs()
    return serve_until_stopped(uvicorn_config(app, args.host, args.port, limits),
                               (link.stop if link else (lambda: None)), "agent-proxy")


def engine_client(cfg: Any, link: EngineLink | None) -> Any:
    """The proxy's HTTP client: over the engine's Unix socket in-process, else over TCP."""
    import httpx

    transport = httpx.AsyncHTTPTransport(uds=link.uds) if link is not None else None
    return httpx.AsyncClient(transport=transport,
                             timeout=httpx.Timeout(None, connect=cfg.connect_timeout_s),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=64))
