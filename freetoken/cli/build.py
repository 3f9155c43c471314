"""The composition root of the serving stack: `build_engine` turns an `EngineConfig` (from
`ft serve` or `ft agent-proxy --model` arguments, cli/options.py `engine_config_from_args`)
into a running `AsyncEngine` — the only module that puts models, experts, engine and chat
together. `load_with_experts` composes a model with its expert runtime (`ft serve`,
`ft generate`, the tests): models/loader.py builds the module only."""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.experts.runtime import MoERuntime
from freetoken.models.loader import place_model, read_model
from freetoken.models.qwen import QwenMoE
from freetoken.types.config import EngineConfig, MoEConfig


def load_with_experts(model_dir: str | Path, moe: MoEConfig | None,
                      dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                      progress: bool = True, kv_reserve_bytes: int = 0,
                      read: Callable[..., dict[str, torch.Tensor]] | None = None
                      ) -> tuple[QwenMoE, MoERuntime | None]:
    """A checkpoint's module and the expert runtime `moe` asks for (None: no runtime, every
    expert resident, as `load_model`). The runtime is built between reading the module on the
    host and placing it: a non-fused backend takes the routed experts' banks into the host
    expert store and the slot cache first, so only the rest of the model moves to `device`.
    `read`: models/loader.py `read_model`'s (random weights or the checkpoint's files)."""
    t0 = time.perf_counter()
    model = read_model(model_dir, dtype, device, progress, read)
    rt = MoERuntime.build(model, moe, device, kv_reserve_bytes) if moe is not None else None
    model = place_model(model, device, cpu_kernels=rt is not None and rt.computes_on_cpu,
                        name=Path(model_dir).name, started=t0)
    return model, rt


def build_engine(cfg: EngineConfig) -> AsyncEngine:
    """Load the checkpoint `cfg.model` with its expert runtime, install the routing hooks the
    config asks for, and start the engine (warmed up on CUDA: kernels compiled, graphs
    captured before the first request)."""
    from freetoken.chat import ChatTokenizer
    from freetoken.cli.options import resolve_device, resolve_dtype, resolve_moe
    from freetoken.engine.sizing import default_chunk_tokens, default_kv_tokens
    from freetoken.models.demo import DEMO_ALIASES, resolve_model_path
    marks = StartMarks()
    model_dir = resolve_model_path(cfg.model)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype)
    moe, reserve = None, 0
    if cfg.moe is not None:
        moe, reserve = resolve_moe(cfg.moe, cfg.moe_backend_given, cfg.max_context,
                                   model_dir, dtype, device)
    marks.mark("resolve")
    # the tokenizer (1-2 s of parsing) loads beside the weights, whose reads and copies run
    # outside the interpreter lock; `tokenizer_s` is what the start still waits for after them
    with ThreadPoolExecutor(1, thread_name_prefix="ft-tokenizer") as pool:
        tok_future = pool.submit(ChatTokenizer.from_dir, model_dir)
        model, rt = load_with_experts(model_dir, moe, dtype=dtype, device=device,
                                      kv_reserve_bytes=reserve)
        marks.mark("load")
        tok = tok_future.result()
    marks.mark("tokenizer")
    install_routing_hooks(model, cfg)
    max_context = cfg.max_context or model.cfg.max_position_embeddings
    cache = cfg.cache
    core = EngineCore(
        model, tok.eos_token_ids,
        kv_tokens=cache.kv_tokens or default_kv_tokens(model, max_context, moe),
        state_slots=cache.state_slots,
        max_running=cfg.max_running,
        chunk_tokens=cache.chunk_tokens or default_chunk_tokens(rt),
        max_context=cfg.max_context,
        policy=cache.checkpoint_policy,
        cuda_graph=cfg.cuda_graph,
        decode_attention=cfg.decode_attention,
        state_host_mem=cache.state_host_mem,
        moe=rt,
        kept_logits=cache.kept_logits,
    )
    marks.mark("engine")
    name = cfg.model if cfg.model in DEMO_ALIASES else model_dir.name
    engine = AsyncEngine(core, model_dir, name)
    engine.max_output_tokens = cfg.max_output_tokens
    engine.tokenizer = tok  # (`ft serve` and the proxy serve with it: loaded once, ~1-2 s)
    _warm_up(engine, cfg.warm_up)
    marks.mark("warm_up")
    _elastic(engine, cfg, moe, rt)
    marks.mark("elastic")
    marks.log()
    return engine


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None where that is unknown."""
    import os

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartMarks:
    """Seconds of each start-up stage of `build_engine`, logged as one `startup_phases` line
    (`before` = from process start to the build: the interpreter and the imports), so that a
    start's time outside the weight load is split (issue #24: a restart is ready in load +
    12 s on the H200 where the goal is load + 5 s; `ft bench serve` reads the line)."""

    def __init__(self) -> None:
        self.before = process_age_s()
        self.t = time.perf_counter()
        self.stages: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[name] = now - self.t
        self.t = now

    def log(self) -> None:
        from freetoken.log import get_logger, kv

        fields = {"before_s": f"{self.before:.2f}"} if self.before is not None else {}
        fields |= {f"{k}_s": f"{v:.3f}" for k, v in self.stages.items()}
        get_logger("server").info(kv("startup_phases", **fields))


def install_routing_hooks(model, cfg: EngineConfig) -> None:
    """`--record-routing FILE` (saved at exit) and the hidden `--route-trace` of `ft bench
    serve` (a replayed trained router for a random-weight model)."""
    if cfg.record_routing:
        from freetoken.models.routing_hooks import attach_recorder

        attach_recorder(model, cfg.record_routing)
    if cfg.route_trace:
        from freetoken.models.routing_hooks import install_serve_trace

        install_serve_trace(model, cfg.route_trace, cfg.max_running)


def _warm_up(engine: AsyncEngine, mode: str | None) -> None:
    """`--warm-up`: `idle` (default on CUDA) makes the warm-up tasks run between requests
    while the engine has nothing else to do (engine/warm_up.py), from when the caller's HTTP
    server starts (`AsyncEngine.begin_warm_up`): the server answers at once; `blocking` runs
    them all before serving; `off` (default on the CPU, which compiles no kernels) none,
    graphs are then captured at the first step of each bucket."""
    core = engine.core
    mode = mode or ("idle" if core.device.type == "cuda" else "off")
    if mode == "blocking":
        core.warm_up()
    engine.warm_up_idle = mode == "idle"


def _elastic(engine: AsyncEngine, cfg: EngineConfig, moe, rt) -> None:
    """Elastic VRAM (the rebuild, its watcher on CUDA) and bandwidth re-profiling."""
    from freetoken.engine.vram_plan import HYSTERESIS_BYTES, VramKnobs
    from freetoken.engine.vram_watch import REBUILD_WAIT_S, WATCH_INTERVAL_S, attach_elastic

    v = cfg.vram
    interval = WATCH_INTERVAL_S if v.watch_interval_s is None else v.watch_interval_s
    knobs = VramKnobs(hysteresis_bytes=HYSTERESIS_BYTES if v.hysteresis_bytes is None
                      else v.hysteresis_bytes)
    # an expert budget the user gave is a ceiling for the watcher (bug: a 20-layer server
    # started with --moe-cache-rate 0.37 grew to every expert 3 s after ready, H200 2026-12-02)
    given = moe is not None and any(x is not None for x in (moe.cache_size, moe.cache_rate,
                                                            moe.cache_mem))
    ceiling = rt.cache.num_slots if given and rt is not None and rt.cache is not None else None
    attach_elastic(engine, knobs, interval_s=interval,
                   kv_floor=moe.kv_reserve_tokens if moe is not None else None,
                   max_expert_slots=ceiling,
                   rebuild_wait_s=REBUILD_WAIT_S if v.rebuild_wait_s is None
                   else v.rebuild_wait_s)
    steps = v.bw_reprofile_steps
    if rt is not None and steps and steps > 0:
        rt.enable_reprofile(every_steps=steps)
