"""Engine configuration as frozen dataclasses that validate themselves on construction.

`MoEConfig` is the expert runtime's (experts/runtime.py): which backend, how large the GPU
expert cache is, the CPU branch and the prefill streamer. The flag group that fills it is
`add_moe_args` in freetoken/cli/options.py.
"""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "fused", "offload", "cpu", "hybrid")
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
