"""Routing traces: the file `--record-routing FILE` writes, and `load_trace` for the benches.
The recorder (`RoutingRecorder`, `attach_recorder`) is a product hook on the model's routers,
in freetoken/models/routing_hooks.py, re-exported here.

Trace file format (`.npz`, written by `RoutingRecorder.save`, one decoded sequence):
  decode       uint8 (E <= 256) or int16 `[steps, L, K]`: expert ids chosen at each decode step
  prefill      optional, same dtype, `[L, T, K]`: expert ids of the prompt's T tokens
  num_experts  int64 scalar; top_k int64 scalar
The shared traces (`envs.routing_traces_dir()`: FT_ROUTING_TRACES, else the copy in
workloads/data/routing_traces; decode_routing.npy
`[steps, L, N, K]`, prefill_routing.npy `[L, N, T, K]`) load into the same in-memory form,
`RoutingTrace`, which is sequence-major: decode `[N, steps, L, K]`, prefill `[N, L, T, K]`
(or None).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freetoken.envs import routing_traces_dir
from freetoken.models.routing_hooks import RoutingRecorder, attach_recorder  # noqa: F401


@dataclass(frozen=True)
class RoutingTrace:
    """N sequences of routing. decode `[N, steps, L, K]`, prefill `[N, L, T, K]` or None."""

    decode: np.ndarray
    prefill: np.ndarray | None
    num_experts: int
    top_k: int
    name: str = ""

    @property
    def num_layers(self) -> int:
        return int(self.decode.shape[2])

    @property
    def num_sequences(self) -> int:
        return int(self.decode.shape[0])


def load_trace(source: str | Path) -> RoutingTrace:
    """Load a recorder `.npz` file, or a directory in the shared-trace layout ("shared" = the
    shared traces)."""
    path = routing_traces_dir() if str(source) == "shared" else Path(source)
    if path.is_dir():
        decode = np.load(path / "decode_routing.npy")  # [steps, L, N, K]
        pre_path = path / "prefill_routing.npy"
        prefill = np.load(pre_path).transpose(1, 0, 2, 3) if pre_path.exists() else None
        num_experts = 256
        meta = path / "meta.json"
        if meta.exists():
            num_experts = int(json.loads(meta.read_text()).get("num_experts", num_experts))
        return RoutingTrace(decode.transpose(2, 0, 1, 3), prefill, num_experts,
                            int(decode.shape[-1]), path.name)
    with np.load(path) as z:
        prefill = z["prefill"][None] if "prefill" in z.files else None
        return RoutingTrace(z["decode"][None], prefill, int(z["num_experts"]), int(z["top_k"]),
                            path.stem)
