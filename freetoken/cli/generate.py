"""`ft generate`: one prompt through the plain generation path, streamed to the terminal."""
from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("--model", default="demo", help="checkpoint directory, 'demo' or 'demo-random'")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="with --chat: the template's thinking switch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--record-routing", default=None, metavar="FILE",
                   help="write the per-step, per-layer routed expert ids to FILE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    from freetoken.cli.options import add_moe_args

    add_moe_args(p)  # the expert backend and cache flags of `ft serve`, to compare backends
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from freetoken.chat import ChatTokenizer, IncrementalDetokenizer
    from freetoken.cli.build import load_with_experts
    from freetoken.cli.options import moe_from_args
    from freetoken.engine.generate import generate
    from freetoken.models.demo import resolve_model_path
    from freetoken.types.api import SamplingParams

    model_dir = resolve_model_path(args.model)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    moe, reserve = moe_from_args(args, model_dir, dtype, args.device)
    model, rt = load_with_experts(model_dir, moe, dtype=dtype, device=args.device,
                                  progress=not args.json, kv_reserve_bytes=reserve)
    assert rt is not None  # (a config always gives a runtime; `fused` has no slot cache)
    tok = ChatTokenizer.from_dir(model_dir)
    if args.chat:
        thinking = None if args.thinking is None else args.thinking == "on"
        ids = tok.apply(
            [{"role": "user", "content": args.prompt}], enable_thinking=thinking
        ).input_ids
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        print("error: the prompt is empty after tokenization", file=sys.stderr)
        return 2
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    sampling.validate()
    recorder = None
    if args.record_routing:
        from freetoken.models.routing_hooks import attach_recorder

        recorder = attach_recorder(model)
    detok = IncrementalDetokenizer(tok)
    on_token = None if args.json else (lambda t: print(detok.push([t]), end="", flush=True))
    res = generate(model, ids, sampling, tok.eos_token_ids, on_token=on_token, moe=rt)
    if recorder is not None:
        recorder.save(args.record_routing)
    if args.json:
        print(json.dumps({"prompt_token_ids": ids, "token_ids": res.token_ids,
                          "text": tok.decode(res.token_ids), "finish_reason": res.finish_reason,
                          "prefill_seconds": round(res.prefill_seconds, 4),
                          "decode_tokens_per_second": round(res.decode_tps, 2),
                          "moe_backend": rt.backend, "moe_stats": rt.counters.as_dict()}))
    else:
        print(detok.flush())
        pf = len(ids) / res.prefill_seconds if res.prefill_seconds > 0 else 0.0
        print(f"\n[{len(ids)} prompt tokens, {pf:.1f} tok/s prefill; {len(res.token_ids)} tokens, "
              f"{res.decode_tps:.1f} tok/s decode; finish={res.finish_reason}; "
              f"moe={rt.backend}]", file=sys.stderr)
    return 0
