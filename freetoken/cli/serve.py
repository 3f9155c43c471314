"""`ft serve`: load a model into the engine and serve the OpenAI/Anthropic/native HTTP API."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from freetoken.log import get_logger, kv
from freetoken.server.front_options import api_key_from, limits_from

__all__ = ["api_key_from", "limits_from", "parser_family_for", "register", "run_serve"]

log = get_logger("server")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over OpenAI / Anthropic HTTP APIs")
    p.add_argument("--model", default="demo",
                   help="checkpoint directory, 'demo' (the built-in tiny trained demo model) or "
                        "'demo-random' (its random-weight, never-ending sibling)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    from freetoken.server.front_options import add_front_door_args

    add_front_door_args(p)  # the key, allowed hosts and limits: shared with ft agent-proxy
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
    # checkpoint policy), shared with `ft agent-proxy --model`; read by engine_config_from_args.
    from freetoken.cli.options import add_cache_args, add_moe_args

    add_moe_args(p)
    add_cache_args(p)
    p.add_argument("--warm-up", choices=("idle", "blocking", "off"), default=None,
                   help="kernel compilation and graph capture: idle (default on CUDA: between "
                        "requests, the server answers at once), blocking (before serving) or "
                        "off (default on the CPU)")
    # `ft bench serve --route-trace`: route a random-weight model by a replayed trained router
    p.add_argument("--route-trace", default=None, help=argparse.SUPPRESS)
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


def run_serve(args: argparse.Namespace) -> int:
    from freetoken.chat import ChatTokenizer
    from freetoken.cli.build import build_engine
    from freetoken.cli.options import engine_config_from_args
    from freetoken.server.app import create_app
    from freetoken.server.generation import default_output_cap
    from freetoken.server.lifecycle import serve_until_stopped
    from freetoken.server.limits import quiet_connection_logs, uvicorn_config

    api_key = api_key_from(args, dict(os.environ))
    limits = limits_from(args)
    engine = build_engine(engine_config_from_args(args))
    engine.max_output_tokens = default_output_cap(args.model, args.max_output_tokens)
    tokenizer = (getattr(engine, "tokenizer", None)
                 or ChatTokenizer.from_dir(engine.model_dir))  # type: ignore[attr-defined]
    app = create_app(engine, tokenizer, api_key=api_key,
                     served_model_names=args.served_model_name or [engine.model_name],
                     strict_model=args.strict_model,
                     parser_family=parser_family_for(engine.model_dir),  # type: ignore[attr-defined]
                     limits=limits)
    log.info(kv("serve", host=args.host, port=args.port, model=engine.model_name,
                max_context=engine.max_context, auth=bool(api_key),
                max_output_tokens=engine.max_output_tokens,
                max_connections=limits.max_connections))
    quiet_connection_logs()
    engine.begin_warm_up()  # after the setup above, not racing it for the interpreter
    # stop: the engine after its current step, then its threads (server/lifecycle.py)
    return serve_until_stopped(uvicorn_config(app, args.host, args.port, limits),
                               engine.shutdown, "serve")
