"""`ft serve`: load a model into the engine and serve the OpenAI/Anthropic/native HTTP API."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken.envs import FT_API_KEY
from freetoken.log import get_logger, kv

if TYPE_CHECKING:
    from freetoken.server.limits import ServerLimits

log = get_logger("server")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over OpenAI / Anthropic HTTP APIs")
    p.add_argument("--model", default="demo",
                   help="checkpoint directory, or 'demo' for the built-in tiny demo model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (visible in "
                        "`ps`: prefer --api-key-file or the FT_API_KEY environment variable)")
    p.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (first line)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated extra host names accepted in Host and Origin headers "
                        "('*' accepts any); localhost names and the bound address always are")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections past which new ones get 503 and are closed")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds a streaming client may read nothing before its request is "
                        "aborted and its slot freed")
    p.add_argument("--served-model-name", action="append", default=None, dest="served_model_name",
                   help="name listed by /v1/models (repeatable; default: the model's name)")
    p.add_argument("--strict-model", action="store_true",
                   help="answer 404 model_not_found to names not in --served-model-name "
                        "(default: any name is served)")
    p.add_argument(
        "--dtype", default="auto", help="weight/activation dtype (auto, bf16, fp16, fp32)"
    )
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    p.add_argument("--max-running", type=int, default=4, help="concurrently decoding requests")
    p.add_argument("--max-context", type=int, default=None,
                   help="context length in tokens (default: the model's)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: what memory allows)")
    # The engine's own flag groups (MoE backend and expert cache, state slots, chunking,
    # checkpoint policy), shared with `ft agent-proxy --model`; `build_engine` reads them.
    from freetoken.cli.options import add_cache_args, add_moe_args

    add_moe_args(p)
    add_cache_args(p)
    p.set_defaults(func=run_serve)


def parser_family_for(model_dir: Path) -> str:
    """The output-parser family of a checkpoint: its `model_type` (the text model's, for a
    multimodal config; `_text` suffix dropped) when the chat layer knows it, else 'qwen3'."""
    from freetoken.chat.output import FAMILIES

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "qwen3"
    mt = str(cfg.get("model_type", ""))
    text_mt = str((cfg.get("text_config") or {}).get("model_type", ""))
    for name in (mt, mt.removesuffix("_text"), text_mt.removesuffix("_text")):
        if name in FAMILIES:
            return name
    return "qwen3"


def api_key_from(args: argparse.Namespace, environ: dict[str, str]) -> str | None:
    """The key from --api-key, else --api-key-file, else FT_API_KEY; at most one may be given
    (SystemExit otherwise, or for an unreadable or empty file)."""
    given = [n for n, v in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file),
                            (FT_API_KEY.name, FT_API_KEY.get(environ))) if v]
    if len(given) > 1:
        raise SystemExit(f"ft serve: give the API key one way, not {' and '.join(given)}")
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise SystemExit(f"ft serve: cannot read --api-key-file: {e}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise SystemExit(f"ft serve: --api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or FT_API_KEY.get(environ) or None


def limits_from(args: argparse.Namespace) -> ServerLimits:
    from freetoken.server.limits import ServerLimits  # uvicorn: not on every `ft` start

    return ServerLimits(
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        max_body_bytes=int(args.max_body_mb * 2**20), max_connections=args.max_connections,
        stall_timeout_s=args.stall_timeout, bound_host=args.host,
        allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()])


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from freetoken.chat import ChatTokenizer
    from freetoken.cli.build import build_engine
    from freetoken.server.app import create_app
    from freetoken.server.limits import quiet_connection_logs, uvicorn_config

    api_key = api_key_from(args, dict(os.environ))
    limits = limits_from(args)
    engine = build_engine(args)
    tokenizer = ChatTokenizer.from_dir(engine.model_dir)  # type: ignore[attr-defined]
    app = create_app(engine, tokenizer, api_key=api_key,
                     served_model_names=args.served_model_name or [engine.model_name],
                     strict_model=args.strict_model,
                     parser_family=parser_family_for(engine.model_dir),  # type: ignore[attr-defined]
                     limits=limits)
    log.info(kv("serve", host=args.host, port=args.port, model=engine.model_name,
                max_context=engine.max_context, auth=bool(api_key),
                max_connections=limits.max_connections))
    quiet_connection_logs()
    uvicorn.Server(uvicorn_config(app, args.host, args.port, limits)).run()
    return 0
