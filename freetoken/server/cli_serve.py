"""`ft serve`: load a model into the engine and serve the OpenAI/Anthropic/native HTTP API."""
from __future__ import annotations

import argparse

from freetoken.log import get_logger, kv

log = get_logger("server")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over OpenAI / Anthropic HTTP APIs")
    p.add_argument("--model", default="demo",
                   help="checkpoint directory, or 'demo' for the built-in tiny demo model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
    p.add_argument("--served-model-name", action="append", default=None, dest="served_model_name",
                   help="name listed by /v1/models (repeatable; default: the model's name)")
    p.add_argument("--strict-model", action="store_true",
                   help="answer 404 model_not_found to names not in --served-model-name "
                        "(default: any name is served)")
    p.add_argument("--dtype", default="auto", help="weight/activation dtype (auto, bf16, fp16, fp32)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    p.add_argument("--max-running", type=int, default=4, help="concurrently decoding requests")
    p.add_argument("--max-context", type=int, default=None,
                   help="context length in tokens (default: the model's)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: what memory allows)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from freetoken.chat import ChatTokenizer
    from freetoken.engine.async_engine import build_engine
    from freetoken.server.app import create_app

    engine = build_engine(args)
    tokenizer = ChatTokenizer.from_dir(engine.model_dir)  # type: ignore[attr-defined]
    app = create_app(engine, tokenizer, api_key=args.api_key,
                     served_model_names=args.served_model_name or [engine.model_name],
                     strict_model=args.strict_model)
    log.info(kv("serve", host=args.host, port=args.port, model=engine.model_name))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_keep_alive=75)
    return 0
