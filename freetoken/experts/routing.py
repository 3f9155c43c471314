"""Routing traces: record, save, load, and generate synthetic ones with tunable locality.

File format (`.npz`, written by `RoutingRecorder.save`, one decoded sequence):
  decode       uint8 (E <= 256) or int16 `[steps, L, K]`: expert ids chosen at each decode step
  prefill      optional, same dtype, `[L, T, K]`: expert ids of the prompt's T tokens
  num_experts  int64 scalar; top_k int64 scalar
The shared traces (a copy of ../shared/routing_traces in workloads/data: decode_routing.npy `[steps, L, N, K]`,
prefill_routing.npy `[L, N, T, K]`) load into the same in-memory form, `RoutingTrace`, which is
sequence-major: decode `[N, steps, L, K]`, prefill `[N, L, T, K]` (or None).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import Tensor

# A copy of ../shared/routing_traces (a trained router's routing) travels with the package.
SHARED_TRACE_DIR = Path(__file__).resolve().parents[2] / "workloads" / "data" / "routing_traces"

# Synthetic routing: per-layer popularity ~ 1/(rank+1)**ZIPF_EXPONENT, and each expert of the
# previous step is kept with probability `locality`. SYNTH_LOCALITY_QWEN36 is the locality at which
# a global LRU holding 37% of a Qwen3.6-35B-A3B-sized pool (40 layers x 256 experts, top-8) misses
# 16% of routed experts, the figure the FreeToken paper reports for that model (calibrated by
# `calibrate_locality` with the CALIBRATION_* settings below).
ZIPF_EXPONENT = 0.8
SYNTH_LOCALITY_QWEN36 = 0.583
QWEN36_SHAPE = (40, 256, 8)  # layers, experts, top-k
CALIBRATION_CAPACITY = 0.37
CALIBRATION_TARGET_MISS = 0.16
CALIBRATION_STEPS = 1024
CALIBRATION_WARMUP = 128


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


def synthetic_trace(
    num_layers: int,
    num_experts: int,
    top_k: int,
    steps: int,
    locality: float,
    seed: int = 0,
    zipf: float = ZIPF_EXPONENT,
) -> np.ndarray:
    """`[steps, L, K]` int64 routing of one sequence with tunable temporal locality.

    Each layer has its own popularity (a random permutation of Zipf ranks). At every step each
    expert of the previous step is kept with probability `locality`; the remaining picks are drawn
    without replacement by popularity (Gumbel top-k, so one vectorised draw covers all layers).
    locality=0 gives independent steps; locality=1 repeats the first step forever.
    """
    if not 0.0 <= locality <= 1.0:
        raise ValueError("locality must be in [0, 1]")
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])  # [L, E]
    log_pop = -zipf * np.log(ranks + 1.0)  # [L, E]
    rows = np.arange(num_layers)[:, None]  # [L, 1]
    out = np.empty((steps, num_layers, top_k), np.int64)  # [steps, L, K]
    prev: np.ndarray | None = None
    for t in range(steps):
        keys = log_pop + rng.gumbel(size=log_pop.shape)  # [L, E]
        if prev is not None:
            keep = rng.random(prev.shape) < locality  # [L, K]
            keys[rows, prev] = np.where(keep, np.inf, keys[rows, prev])
        prev = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]  # [L, K]
        out[t] = prev
    return out


def synthetic_routing(
    num_layers: int,
    num_experts: int,
    top_k: int,
    steps: int,
    locality: float,
    prompt_tokens: int = 256,
    seed: int = 0,
) -> RoutingTrace:
    """One synthetic sequence: the first `prompt_tokens` steps become the prefill."""
    ids = synthetic_trace(num_layers, num_experts, top_k, prompt_tokens + steps, locality, seed)
    prefill = ids[:prompt_tokens].transpose(1, 0, 2)[None]  # [1, L, T, K]
    return RoutingTrace(ids[prompt_tokens:][None], prefill, num_experts, top_k,
                        f"synthetic(locality={locality:.3f})")


def calibrate_locality(
    target_miss: float = CALIBRATION_TARGET_MISS,
    capacity: float = CALIBRATION_CAPACITY,
    shape: tuple[int, int, int] = QWEN36_SHAPE,
    steps: int = CALIBRATION_STEPS,
    warmup: int = CALIBRATION_WARMUP,
    seed: int = 0,
    iters: int = 12,
) -> float:
    """Bisect the locality at which a global LRU of `capacity` x pool misses `target_miss`.

    The miss rate falls monotonically with locality (up to sampling noise, fixed by `seed`).
    """
    from freetoken.experts.replay import lru_miss_rate

    layers, experts, top_k = shape
    slots = round(capacity * layers * experts)
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        trace = synthetic_trace(layers, experts, top_k, steps, mid, seed)
        if lru_miss_rate(trace, experts, slots, warmup) > target_miss:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3)
