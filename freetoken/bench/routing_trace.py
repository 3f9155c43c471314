"""`--record-routing FILE`: hook every MoE block's router and save the routed expert ids.

Decode steps (one token in the batch) are recorded per step and layer; multi-token batches
(prefill chunks) are recorded as prefill routing. With several concurrent requests the decode
record interleaves them: record single-stream sessions for clean traces.

Trace file format (`.npz`, written by `RoutingRecorder.save`, one decoded sequence):
  decode       uint8 (E <= 256) or int16 `[steps, L, K]`: expert ids chosen at each decode step
  prefill      optional, same dtype, `[L, T, K]`: expert ids of the prompt's T tokens
  num_experts  int64 scalar; top_k int64 scalar
The shared traces (a copy of ../shared/routing_traces in workloads/data: decode_routing.npy
`[steps, L, N, K]`, prefill_routing.npy `[L, N, T, K]`) load into the same in-memory form,
`RoutingTrace`, which is sequence-major: decode `[N, steps, L, K]`, prefill `[N, L, T, K]`
(or None).
"""
from __future__ import annotations

import atexit
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from freetoken.log import get_logger, kv

if TYPE_CHECKING:
    from freetoken.models.qwen import QwenMoE

# A copy of ../shared/routing_traces (a trained router's routing) travels with the package.
SHARED_TRACE_DIR = Path(__file__).resolve().parents[2] / "workloads" / "data" / "routing_traces"

log = get_logger("experts")


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


def _id_dtype(num_experts: int) -> type[np.integer]:
    return np.uint8 if num_experts <= 256 else np.int16


class RoutingRecorder:
    """Collects one sequence's routing as the model runs; `save(path)` writes the .npz format.

    Call `record(layer, ids)` once per MoE layer per decode step (ids `[K]` or `[1, K]`), and
    `record_prefill(layer, ids [T, K])` for prompt chunks (chunks of a layer are concatenated).
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self._decode: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
        self._prefill: list[list[np.ndarray]] = [[] for _ in range(num_layers)]

    def _as_ids(self, ids: Tensor | np.ndarray) -> np.ndarray:
        arr = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
        if arr.shape[-1] != self.top_k:
            raise ValueError(f"expected top_k={self.top_k} ids per token, got {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_experts):
            raise ValueError("expert id out of range")
        return arr.astype(_id_dtype(self.num_experts))

    def record(self, layer: int, ids: Tensor | np.ndarray) -> None:
        self._decode[layer].append(self._as_ids(ids).reshape(self.top_k))

    def record_prefill(self, layer: int, ids: Tensor | np.ndarray) -> None:
        self._prefill[layer].append(self._as_ids(ids).reshape(-1, self.top_k))

    @property
    def steps(self) -> int:
        return min(len(x) for x in self._decode)

    def decode_array(self) -> np.ndarray:
        """`[steps, L, K]` over the steps that every layer completed."""
        n = self.steps
        dt = _id_dtype(self.num_experts)
        if n == 0:
            return np.zeros((0, self.num_layers, self.top_k), dt)
        return np.stack([np.stack(layer[:n]) for layer in self._decode], axis=1)

    def save(self, path: str | Path) -> None:
        arrays: dict[str, np.ndarray] = {
            "decode": self.decode_array(),
            "num_experts": np.int64(self.num_experts),
            "top_k": np.int64(self.top_k),
        }
        if all(self._prefill):
            arrays["prefill"] = np.stack([np.concatenate(x) for x in self._prefill])
        np.savez_compressed(path, **arrays)


def load_trace(source: str | Path) -> RoutingTrace:
    """Load a recorder `.npz` file, or a directory in the shared-trace layout ("shared" = the
    shared traces)."""
    path = SHARED_TRACE_DIR if str(source) == "shared" else Path(source)
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


def attach_recorder(model: QwenMoE, path: str | None = None) -> RoutingRecorder:
    """Install the hooks; with `path`, also save there at interpreter exit."""
    blocks = model.moe_blocks()
    cfg = model.cfg
    rec = RoutingRecorder(len(blocks), cfg.num_experts, cfg.top_k)
    for m, b in enumerate(blocks):
        def hook(_layer_id: int, ids: torch.Tensor, _m: int = m) -> None:
            if ids.shape[0] == 1:
                rec.record(_m, ids[0])
            else:
                rec.record_prefill(_m, ids)

        b.route_hook = hook
    if path:
        def save() -> None:
            rec.save(path)
            log.info(kv("routing_saved", path=path, steps=rec.steps))

        atexit.register(save)
    return rec
