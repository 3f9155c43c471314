"""`ft agent-proxy`: the proxy in front of our engine (in-process demo or `--model PATH`, or an
`ft serve` spoken to natively with `--native-url`) or in front of any OpenAI/Anthropic server
(`--upstream URL`)."""
from __future__ import annotations

import argparse
import socket
import threading
import time
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
                        "--native-url: the key of that `ft serve --api-key`)")
    p.add_argument("--tokenizer", default=None, help="checkpoint directory with the tokenizer "
                   "(native mode; API mode uses it only for count_tokens)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--output-cap", action="append", default=None, metavar="N|HARNESS=N",
                   help="cap each reply at N tokens (repeatable, per harness); a reply stopped "
                        "by the cap ends as a normal turn. Default with the demo model: 256")
    p.add_argument("--step", action="append", default=None, metavar="NAME=on|off",
                   help="switch a normalisation step (see docs/proxy.md)")
    p.add_argument("--harness", default=None, help="force one adapter instead of detecting")
    p.add_argument("--fold-system", default="auto", choices=("auto", "keep", "fold"))
    p.add_argument("--metrics", default=None, metavar="FILE",
                   help="JSONL record per request (default ~/.cache/freetoken/proxy.jsonl)")
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


def start_engine_server(args: argparse.Namespace) -> tuple[str, Any, str]:
    """Our engine and the `ft serve` app on a loopback port in a background thread; returns
    (base URL, tokenizer, parser family)."""
    import uvicorn

    from freetoken.chat import ChatTokenizer
    from freetoken.cli.build import build_engine
    from freetoken.cli.serve import parser_family_for
    from freetoken.server.app import create_app

    engine = build_engine(args)
    tok = ChatTokenizer.from_dir(engine.model_dir)  # type: ignore[attr-defined]
    family = parser_family_for(engine.model_dir)  # type: ignore[attr-defined]
    app = create_app(engine, tok, api_key=None, served_model_names=[engine.model_name],
                     parser_family=family)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", timeout_keep_alive=75))
    threading.Thread(target=server.run, daemon=True, name="ft-engine-http").start()
    t0 = time.time()
    while not server.started:
        if time.time() - t0 > 60:
            raise RuntimeError("the in-process engine server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", tok, family


def build_config(args: argparse.Namespace, native_url: str | None) -> Any:
    from freetoken.proxy.config import DEMO_OUTPUT_CAP, ProxyConfig, parse_caps
    from harness_adapters.normalise import parse_step_switches

    caps = parse_caps(args.output_cap)
    demo = native_url is not None and args.native_url is None and (args.model or "demo") == "demo"
    if demo and "*" not in caps:
        caps["*"] = DEMO_OUTPUT_CAP
    metrics = args.metrics or str(Path.home() / ".cache" / "freetoken" / "proxy.jsonl")
    return ProxyConfig(upstream=args.upstream, upstream_api=args.upstream_api,
                       upstream_api_key=args.upstream_api_key, native_url=native_url,
                       tokenizer_dir=args.tokenizer, caps=caps,
                       steps=parse_step_switches(args.step), metrics_path=metrics,
                       ping_s=args.ping_s, force_harness=args.harness,
                       fold_system=args.fold_system)


def banner(url: str, cfg: Any) -> str:
    mode = f"upstream {cfg.upstream}" if cfg.upstream else f"our engine ({cfg.native_url})"
    lines = [f"ft agent-proxy on {url} -> {mode}",
             (f"  output caps: {cfg.caps or 'none'}   stats: {url}/proxy/stats   "
             f"records: {cfg.metrics_path}"),
             "Point a harness at it (prints the env/config; --write DIR writes it):"]
    for h in ("claude", "opencode", "openclaw", "mini"):
        lines.append(f"  ft launch {h} --proxy {url}")
    lines.append(f"  e.g.  eval \"$(ft launch claude --proxy {url})\" && claude")
    return "\n".join(lines)


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
    from freetoken.cli.serve import parser_family_for
    from freetoken.proxy.app import create_proxy_app

    tok, family = None, "qwen3"
    native_url = args.native_url
    if args.upstream is None and native_url is None:
        native_url, tok, family = start_engine_server(args)
    elif native_url is not None:
        if not args.tokenizer:
            raise SystemExit("ft agent-proxy: --native-url needs --tokenizer DIR")
        tok, family = ChatTokenizer.from_dir(args.tokenizer), parser_family_for(args.tokenizer)
    else:
        tok = ChatTokenizer.from_dir(args.tokenizer or qwen3_tokenizer_dir())
    cfg = build_config(args, native_url)
    app = create_proxy_app(cfg, tok, family)
    url = f"http://{args.host}:{args.port}"
    print(banner(url, cfg), flush=True)
    log.info(kv("agent_proxy", host=args.host, port=args.port, native=cfg.native))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=75)
    return 0
