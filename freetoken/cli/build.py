"""The composition root of the serving stack: `build_engine` turns `ft serve` (and `ft
agent-proxy --model`) arguments into a running `AsyncEngine` — the only module that puts
models, experts, engine and chat together."""
from __future__ import annotations

import argparse

from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore


def build_engine(args: argparse.Namespace) -> AsyncEngine:
    """From `ft serve` arguments: model path/demo, dtype, device, pool sizes."""

    from freetoken.chat import ChatTokenizer
    from freetoken.cli.options import moe_from_args, resolve_device, resolve_dtype
    from freetoken.engine.sizing import default_chunk_tokens, default_kv_tokens
    from freetoken.models.demo import resolve_model_path
    from freetoken.models.loader import load_with_experts

    model_dir = resolve_model_path(getattr(args, "model", None) or "demo")
    device = resolve_device(getattr(args, "device", None))
    dtype = resolve_dtype(getattr(args, "dtype", None))
    moe, reserve = None, 0
    if hasattr(args, "moe_backend"):
        moe, reserve = moe_from_args(args, model_dir, dtype, device)
    model, rt = load_with_experts(model_dir, moe, dtype=dtype, device=device,
                                  kv_reserve_bytes=reserve)
    tok = ChatTokenizer.from_dir(model_dir)
    if getattr(args, "record_routing", None):
        from freetoken.bench.routing_trace import attach_recorder

        attach_recorder(model, args.record_routing)
    if getattr(args, "route_trace", None):  # `ft bench serve --route-trace`: replayed routing
        from freetoken.bench.route_trace import install_serve_trace

        install_serve_trace(model, args.route_trace, getattr(args, "max_running", None) or 4)
    max_context = getattr(args, "max_context", None) or model.cfg.max_position_embeddings
    kv_tokens = getattr(args, "kv_tokens", None) or default_kv_tokens(model, max_context, moe)
    core = EngineCore(
        model, tok.eos_token_ids,
        kv_tokens=kv_tokens,
        state_slots=getattr(args, "state_slots", None) or 64,
        max_running=getattr(args, "max_running", None) or 4,
        chunk_tokens=getattr(args, "chunk_tokens", None) or default_chunk_tokens(rt),
        max_context=getattr(args, "max_context", None),
        policy=getattr(args, "checkpoint_policy", None) or "semantic",
        cuda_graph=getattr(args, "cuda_graph", True),
        state_host_mem=getattr(args, "state_host_mem", None),
        moe=rt,
    )
    if core.device.type == "cuda":
        core.warm_up()  # kernel compilation and graph capture before the first request
    from freetoken.models.demo import DEMO_ALIASES

    given = str(getattr(args, "model", "demo") or "demo")
    name = given if given in DEMO_ALIASES else model_dir.name
    engine = AsyncEngine(core, model_dir, name)
    engine.max_output_tokens = getattr(args, "max_output_tokens", None)
    _elastic(engine, args, moe, rt)
    return engine


def _elastic(engine: AsyncEngine, args: argparse.Namespace, moe, rt) -> None:
    """Elastic VRAM (the rebuild, its watcher on CUDA) and bandwidth re-profiling."""
    from freetoken.engine.vram_plan import HYSTERESIS_BYTES, VramKnobs
    from freetoken.engine.vram_watch import REBUILD_WAIT_S, WATCH_INTERVAL_S, attach_elastic

    interval = getattr(args, "vram_watch_interval", WATCH_INTERVAL_S)
    knobs = VramKnobs(hysteresis_bytes=getattr(args, "vram_hysteresis", HYSTERESIS_BYTES))
    attach_elastic(engine, knobs, interval_s=interval,
                   kv_floor=moe.kv_reserve_tokens if moe is not None else None,
                   rebuild_wait_s=getattr(args, "vram_rebuild_wait", REBUILD_WAIT_S))
    steps = getattr(args, "bw_reprofile_steps", 64)
    if rt is not None and steps and steps > 0:
        rt.enable_reprofile(every_steps=steps)
