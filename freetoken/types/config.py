"""Engine configuration as frozen dataclasses that validate themselves on construction.

`MoEConfig` is the expert runtime's (experts/runtime.py): which backend, how large the GPU
expert cache is, the CPU branch and the prefill streamer. `CacheConfig` sizes the KV pool, the
recurrent-state slots and their host tier, and the prefill chunk. `EngineConfig` is everything
`build_engine` (freetoken/cli/build.py) needs to assemble a serving engine: the checkpoint, its
placement, the scheduler's bounds and the two other records. The flag groups that fill them are
in freetoken/cli/options.py (`engine_config_from_args` is the one conversion from arguments).
A ValueError names the flag at fault.
"""
from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("auto", "fused", "offload", "cpu", "hybrid")
POLICIES = ("semantic", "interval", "end_only")  # cache/policy.py: where snapshots are taken
# device memory kept free for activations and workspaces when the slot cache and the KV pool
# are sized from what is free
WORKSPACE_MARGIN_BYTES = 1 << 30


@dataclass(frozen=True)
class MoEConfig:
    backend: str = "fused"
    cache_size: int | None = None  # slots
    cache_rate: float | None = None  # fraction of the pool
    cache_mem: int | None = None  # bytes
    kv_reserve_tokens: int = 8192
    cpu_layers: int = 0  # the last N MoE layers always run on the CPU
    hybrid_max_fetch: int | None = None
    cpu_threads: int | None = None  # CPU branch threads (None: default_cpu_threads)
    prefill_stream: str = "auto"  # auto | on | off (experts/streamer.py)
    prefill_stream_tokens: int | None = None  # the threshold (None: from the profile)
    prefill_overlap: bool = True  # two buffers (off: one, copy and compute serialised)
    prefill_hit_d2d: bool = True  # resident experts stay off the link (read in place)
    # hybrid/auto on a GPU with no saved bandwidth profile: measure one at start (once)
    measure_bw: bool = True

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("--moe-cpu-threads must be at least 1")
        if self.backend not in BACKENDS:
            raise ValueError(f"--moe-backend must be one of {', '.join(BACKENDS)}")
        if self.cache_rate is not None and not 0 < self.cache_rate <= 1:
            raise ValueError("--moe-cache-rate must be in (0, 1]")
        if self.prefill_stream not in ("auto", "on", "off"):
            raise ValueError("--moe-prefill-stream must be one of auto, on, off")
        if self.prefill_stream_tokens is not None and self.prefill_stream_tokens < 2:
            raise ValueError("--moe-prefill-stream-tokens must be at least 2")
        if self.cpu_layers < 0:
            raise ValueError("--moe-cpu-layers must be at least 0")


@dataclass(frozen=True)
class CacheConfig:
    """The engine's pools. None: sized at build from the model and the free memory
    (engine/sizing.py, engine/cache_ops.py)."""

    kv_tokens: int | None = None  # KV pool size in tokens (None: what memory allows)
    state_slots: int = 64  # recurrent-state slots (working states + snapshots)
    state_host_mem: int | None = None  # bytes of the host tier of state snapshots
    chunk_tokens: int | None = None  # prefill token budget per step
    checkpoint_policy: str = "semantic"
    # logits rows kept beside prompt-end snapshots, so a resent prompt (or one token back)
    # computes nothing before its first token (cache/logits.py; None: `state_slots`, 0: off)
    kept_logits: int | None = None

    def __post_init__(self) -> None:
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError("--kv-tokens must be at least 1")
        if self.state_slots < 1:
            raise ValueError("--state-slots must be at least 1")
        if self.state_host_mem is not None and self.state_host_mem < 0:
            raise ValueError("--state-host-mem must be at least 0")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError("--chunk-tokens must be at least 1")
        if self.checkpoint_policy not in POLICIES:
            raise ValueError(f"--checkpoint-policy must be one of {', '.join(POLICIES)}")
        if self.kept_logits is not None and self.kept_logits < 0:
            raise ValueError("--kept-logits must be at least 0")


@dataclass(frozen=True)
class VramConfig:
    """Elastic VRAM and bandwidth re-profiling (docs/server.md). None: the module defaults
    (engine/vram_watch.py, engine/vram_plan.py); `watch_interval_s` 0 turns the watcher off,
    `bw_reprofile_steps` 0 turns re-profiling off."""

    watch_interval_s: float | None = None
    hysteresis_bytes: int | None = None
    rebuild_wait_s: float | None = None
    bw_reprofile_steps: int = 64

    def __post_init__(self) -> None:
        for name in ("watch_interval_s", "hysteresis_bytes", "rebuild_wait_s"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"--{_FLAGS[name]} must be at least 0")
        if self.bw_reprofile_steps < 0:
            raise ValueError("--bw-reprofile-steps must be at least 0")


_FLAGS = {"watch_interval_s": "vram-watch-interval", "hysteresis_bytes": "vram-hysteresis",
          "rebuild_wait_s": "vram-rebuild-wait"}


@dataclass(frozen=True)
class EngineConfig:
    """One serving engine. `moe` None: the command has no MoE flags (every expert resident);
    `moe_backend_given` False: `moe.backend` is a placeholder that build_engine replaces with
    the default for the checkpoint and the device (cli/options.py `default_backend`).
    `record_routing` (a file written at exit) and `route_trace` (`shared` or a .npy replayed
    by the routers, `ft bench serve`) are the two routing hooks."""

    model: str = "demo"  # a checkpoint directory, 'demo' or 'demo-random'
    dtype: str | None = None  # auto, fp32, bf16, fp16 (None: the checkpoint's)
    device: str | None = None  # cuda, cuda:N, cpu, auto (None: auto)
    max_running: int = 4
    max_context: int | None = None  # None: the model's
    max_output_tokens: int | None = None
    cuda_graph: bool = True
    # the decode runner's paged attention: auto (flashinfer when built, Triton while it
    # builds in the background), flashinfer (built before serving), triton
    decode_attention: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    moe: MoEConfig | None = None
    moe_backend_given: bool = True
    record_routing: str | None = None
    route_trace: str | None = None
    warm_up: str | None = None  # idle, blocking, off (None: idle on CUDA, off on the CPU)
    vram: VramConfig = field(default_factory=VramConfig)

    def __post_init__(self) -> None:
        if self.warm_up not in (None, "idle", "blocking", "off"):
            raise ValueError("--warm-up must be idle, blocking or off")
        if self.decode_attention not in ("auto", "flashinfer", "triton"):
            raise ValueError("--decode-attention must be auto, flashinfer or triton")
        if self.max_running < 1:
            raise ValueError("--max-running must be at least 1")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError("--max-context must be at least 1")
        if self.max_output_tokens is not None and self.max_output_tokens < 0:
            raise ValueError("--max-output-tokens must be at least 0")
