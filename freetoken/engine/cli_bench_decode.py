"""`ft bench decode`: prefill and decode tok/s of the plain generation path on one model.

The figure is printed next to the weight-read floor: a decode step must read every active
weight once (attention + shared + top-k routed experts), so `active_bytes / mem_bw` bounds
the step time from below when memory bandwidth is measured (`--mem-gbps`).
"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="prefill and decode tok/s")
    p.add_argument("--model", default="demo")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mem-gbps", type=float, default=None,
                   help="memory bandwidth for the floor (GB/s); omitted: no floor printed")
    p.set_defaults(func=run)


def active_weight_bytes(model) -> int:  # noqa: ANN001
    """Bytes a single-token decode step reads: everything except unrouted experts and the
    embedding table (one row)."""
    cfg = model.cfg
    total = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            continue
        if ".experts." in name:
            total += p.numel() * p.element_size() * cfg.top_k // cfg.num_experts
        else:
            total += p.numel() * p.element_size()
    return total


def run(args: argparse.Namespace) -> int:
    import torch

    from freetoken.engine.api import SamplingParams
    from freetoken.engine.generate import generate
    from freetoken.models.demo import resolve_model_path
    from freetoken.models.loader import load_model

    model = load_model(resolve_model_path(args.model),
                       dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist()
    sp = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    generate(model, prompt[:16], SamplingParams(max_tokens=2, temperature=0.0), [])  # warm-up
    best = None
    for r in range(args.repeats):
        res = generate(model, prompt, sp, [])
        print(f"  run {r + 1}/{args.repeats}: prefill {args.prompt_tokens / res.prefill_seconds:.1f} "
              f"tok/s, decode {res.decode_tps:.1f} tok/s", flush=True)
        if best is None or res.decode_tps > best.decode_tps:
            best = res
    assert best is not None
    act = active_weight_bytes(model)
    step = 1.0 / best.decode_tps if best.decode_tps else float("inf")
    print(f"model={args.model} device={args.device} dtype={model.model.norm.weight.dtype}")
    print(f"prefill: {args.prompt_tokens / best.prefill_seconds:10.1f} tok/s ({args.prompt_tokens} tokens)")
    print(f"decode:  {best.decode_tps:10.1f} tok/s  ({args.decode_tokens} tokens; "
          f"{act / 1e6:.1f} MB active weights/token -> {act / step / 1e9:.2f} GB/s achieved)")
    if args.mem_gbps:
        floor = act / (args.mem_gbps * 1e9)
        print(f"floor:   {1 / floor:10.1f} tok/s  (active bytes / {args.mem_gbps} GB/s)")
    return 0
