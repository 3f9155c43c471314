"""Engine flag groups shared by `ft serve`, `ft generate`, `ft agent-proxy --model` and
`ft bench decode`, and their resolution into the typed records of freetoken/types/config.py:
`engine_config_from_args` is the one place where arguments become an `EngineConfig`."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a flag is resolved, not where flags are added:
    import torch  # `ft agent-proxy` adds these flags and must start without it

# --dtype's names -> torch dtype attribute (None: the checkpoint's)
_DTYPES = {"auto": None, "fp32": "float32", "float32": "float32", "bf16": "bfloat16",
           "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def resolve_dtype(name: str | None) -> torch.dtype | None:
    import torch

    if name is None:
        return None
    if name not in _DTYPES:
        raise SystemExit(f"--dtype must be one of {', '.join(_DTYPES)}")
    attr = _DTYPES[name]
    return None if attr is None else getattr(torch, attr)


def resolve_device(name: str | None) -> str:
    import torch

    if not name or name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _size(text: str) -> int:
    units = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower().rstrip("b") if not text.lower().endswith("ib") else text.lower()
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * f)
    return int(float(t))


def add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MoE experts")
    g.add_argument("--moe-backend", default=None,
                   choices=["auto", "fused", "offload", "cpu", "hybrid"],
                   help="default: fused when every expert fits on the device, else auto")
    g.add_argument("--moe-cache-size", type=int, default=None, help="GPU expert slots")
    g.add_argument("--moe-cache-rate", type=float, default=None, help="fraction of the pool")
    g.add_argument("--moe-cache-mem", type=_size, default=None, help="bytes, e.g. 12GiB")
    g.add_argument("--kv-reserve-tokens", type=int, default=8192,
                   help="KV floor reserved before the expert cache takes the rest of VRAM")
    g.add_argument("--moe-cpu-layers", type=int, default=0,
                   help="the last N MoE layers always compute on the CPU")
    g.add_argument("--moe-hybrid-max-fetch", type=int, default=None)
    g.add_argument("--moe-cpu-threads", type=int, default=None,
                   help="threads of the CPU expert branch (default: every core the process "
                        "may use, less one when a GPU is driven from the main thread)")
    g.add_argument("--moe-prefill-stream", default="auto", choices=["auto", "on", "off"],
                   help="stream whole MoE layers through two buffers for long prefill chunks "
                        "(auto: on CUDA, chunks at or above the threshold)")
    g.add_argument("--moe-prefill-stream-tokens", type=int, default=None, metavar="N",
                   help="chunk tokens from which prefill streams (default: derived from the "
                        "measured bandwidth profile; logged at start)")
    g.add_argument("--no-prefill-overlap", dest="prefill_overlap", action="store_false",
                   help="one streaming buffer: copy and compute serialised (for comparison)")
    g.add_argument("--moe-prefill-hit-d2d", dest="prefill_hit_d2d",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="experts already in the GPU cache stay off the link while streaming "
                        "(read in place); --no-moe-prefill-hit-d2d sends every expert over it")
    g.add_argument("--no-bw-measure", dest="measure_bw", action="store_false",
                   help="hybrid/auto on a GPU without a saved bandwidth profile: use the "
                        "fallback bandwidths instead of measuring the machine at start (~12 s "
                        "on an H200 host, once; `ft bench bw` measures it on its own)")


def default_backend(cfg, dtype: torch.dtype, device: str, kv_reserve_tokens: int) -> str:
    """`fused` when all experts, the other weights and the KV floor fit in 90% of free device
    memory (always on the CPU, where the experts are in host RAM either way); else `auto`."""
    if not device.startswith("cuda"):
        return "fused"
    import torch

    from freetoken.cache.tensors import KVPool
    from freetoken.log import get_logger, kv

    el = torch.empty((), dtype=dtype).element_size()
    fmt = cfg.expert_format  # a quantized checkpoint's experts keep their format
    experts = (cfg.expert_bytes(dtype if isinstance(fmt, torch.dtype) else fmt)
               * cfg.num_experts * len(cfg.moe_layers))
    dense = (2 * cfg.vocab_size * cfg.hidden_size + 40 * cfg.hidden_size**2 * cfg.num_layers) * el
    need = experts + dense + KVPool.bytes_per_token(cfg, dtype) * kv_reserve_tokens
    free = torch.cuda.mem_get_info(torch.device(device))[0]
    choice = "fused" if need < 0.9 * free else "auto"
    get_logger("experts").info(kv("default_backend", choice=choice, need_gb=f"{need / 1e9:.1f}",
                                  free_gb=f"{free / 1e9:.1f}"))
    return choice


def moe_options(args: argparse.Namespace, backend: str | None = None):
    from freetoken.types.config import MoEConfig

    return MoEConfig(
        backend=backend or args.moe_backend or "fused",
        cache_size=args.moe_cache_size,
        cache_rate=args.moe_cache_rate,
        cache_mem=args.moe_cache_mem,
        kv_reserve_tokens=args.kv_reserve_tokens,
        cpu_layers=args.moe_cpu_layers,
        hybrid_max_fetch=args.moe_hybrid_max_fetch,
        cpu_threads=getattr(args, "moe_cpu_threads", None),
        prefill_stream=getattr(args, "moe_prefill_stream", "auto"),
        prefill_stream_tokens=getattr(args, "moe_prefill_stream_tokens", None),
        prefill_overlap=getattr(args, "prefill_overlap", True),
        prefill_hit_d2d=getattr(args, "prefill_hit_d2d", True),
        measure_bw=getattr(args, "measure_bw", True),
    )


def moe_from_args(args: argparse.Namespace, model_dir, dtype: torch.dtype | None,
                  device: str):
    """`(MoEConfig, kv_reserve_bytes)` from the MoE flag group for the checkpoint in
    `model_dir` (see `resolve_moe`)."""
    moe = moe_options(args, args.moe_backend or "fused")
    return resolve_moe(moe, args.moe_backend is not None, getattr(args, "max_context", None),
                       model_dir, dtype, device)


def resolve_moe(moe, backend_given: bool, max_context: int | None, model_dir,
                dtype: torch.dtype | None, device: str):
    """`(MoEConfig, kv_reserve_bytes)` for the checkpoint in `model_dir`: a backend not given
    resolves through `default_backend`, and the KV floor and the context's K/V are turned into
    bytes so the slot cache is sized to leave them free."""
    import dataclasses

    import torch

    from freetoken.cache.tensors import KVPool
    from freetoken.types.model_config import load_config

    cfg = load_config(model_dir)
    wdt = dtype or (cfg.torch_dtype if device != "cpu" else torch.float32)
    if not backend_given:
        moe = dataclasses.replace(
            moe, backend=default_backend(cfg, wdt, device, moe.kv_reserve_tokens))
    # the KV pool is sized for the context first (the model's, or --max-context), never below
    # the --kv-reserve-tokens floor; the slot cache is sized to leave that free
    context = max_context or cfg.max_position_embeddings
    tokens = max(moe.kv_reserve_tokens, context)
    return moe, KVPool.bytes_per_token(cfg, wdt) * tokens


def engine_config_from_args(args: argparse.Namespace):
    """The `EngineConfig` of `ft serve` / `ft agent-proxy --model` arguments (flags a command
    lacks take the record's defaults). A value out of range exits with the flag's name."""
    from freetoken.types.config import CacheConfig, EngineConfig, VramConfig

    def get(name: str, default=None):
        value = getattr(args, name, None)
        return default if value is None else value

    try:
        has_moe = hasattr(args, "moe_backend")
        return EngineConfig(
            model=str(get("model", "demo") or "demo"),
            dtype=get("dtype"),
            device=get("device"),
            max_running=get("max_running", 4),
            max_context=get("max_context"),
            max_output_tokens=get("max_output_tokens"),
            cuda_graph=get("cuda_graph", True),
            decode_attention=get("decode_attention", "auto"),
            cache=CacheConfig(kv_tokens=get("kv_tokens"), state_slots=get("state_slots", 64),
                              state_host_mem=get("state_host_mem"),
                              chunk_tokens=get("chunk_tokens"),
                              checkpoint_policy=get("checkpoint_policy", "semantic"),
                              kept_logits=get("kept_logits")),
            moe=moe_options(args, args.moe_backend or "fused") if has_moe else None,
            moe_backend_given=has_moe and args.moe_backend is not None,
            record_routing=get("record_routing"),
            route_trace=get("route_trace"),
            warm_up=get("warm_up"),
            vram=VramConfig(watch_interval_s=get("vram_watch_interval"),
                            hysteresis_bytes=get("vram_hysteresis"),
                            rebuild_wait_s=get("vram_rebuild_wait"),
                            bw_reprofile_steps=get("bw_reprofile_steps", 64)),
        )
    except ValueError as e:
        raise SystemExit(f"ft: {e}") from None


def parse_bytes_arg(text: str) -> int:
    """`123`, `512M`, `8G`, `1.5T` (binary units) to bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 8G, 512M)") from None


def add_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("caches and scheduling")
    g.add_argument("--state-slots", type=int, default=64,
                   help="recurrent-state slots (working states + snapshots), models with "
                        "linear attention")
    g.add_argument("--state-host-mem", type=parse_bytes_arg, default=None, metavar="BYTES",
                   help="host-RAM tier for state snapshots evicted from the device (e.g. 8G; "
                        "default: a quarter of the RAM free after loading, <= 16x --state-slots)")
    g.add_argument("--chunk-tokens", type=int, default=None,
                   help="prefill token budget per step (default: 8192 when prefill streams "
                        "whole MoE layers, else 512)")
    g.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap every reply at N tokens (header x-ft-output-cap; a reply stopped "
                        "there ends as a normal turn). `ft serve` default: 256 for the demo "
                        "models (demo, demo-random), none otherwise; 0 = no cap")
    g.add_argument("--checkpoint-policy", default="semantic",
                   choices=["semantic", "interval", "end_only"])
    g.add_argument("--kept-logits", type=int, default=None, metavar="N",
                   help="logits rows kept beside prompt-end snapshots, so that a resent prompt "
                        "(or the prompt one token back) computes nothing before its first "
                        "token (models with linear attention; one row is vocab floats on the "
                        "device; default: --state-slots; 0: off, a resend then feeds its last "
                        "token again)")
    g.add_argument("--record-routing", default=None, metavar="FILE",
                   help="write the routed expert ids of every step and layer to FILE at exit")
    g.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run decode steps eagerly through the runner's buffers (for comparison)")
    g.add_argument("--decode-attention", choices=("auto", "flashinfer", "triton"), default="auto",
                   help="paged decode attention on CUDA: auto (flashinfer when its module is "
                        "built; while it is not, Triton, and flashinfer built in the background "
                        "and switched to between steps), flashinfer (built before serving if "
                        "needed), triton")
    e = p.add_argument_group("elastic VRAM (docs/server.md)")
    e.add_argument("--vram-watch-interval", type=float, default=2.0, metavar="SECONDS",
                   help="poll free GPU memory and re-plan the expert cache / KV pool this often "
                        "(0: off; CUDA only)")
    e.add_argument("--vram-hysteresis", type=parse_bytes_arg, default=512 * 2**20,
                   metavar="BYTES", help="free memory may stray this far from the workspace "
                                         "margin before a re-plan (default 512MiB)")
    e.add_argument("--vram-rebuild-wait", type=float, default=30.0, metavar="SECONDS",
                   help="a new request waits this long for a rebuild, then gets 503 + "
                        "Retry-After")
    e.add_argument("--bw-reprofile-steps", type=int, default=64, metavar="N",
                   help="re-measure B_P/B_H from decode traffic and re-derive q* every N steps "
                        "(hybrid, auto; 0: off)")
