"""Synthetic routing traces with tunable locality, and the locality calibration.

The trace format and the recorder live in `freetoken.bench.routing_trace` (serving records traces);
this module only makes synthetic ones in the same in-memory form, `RoutingTrace`.
"""
from __future__ import annotations

import numpy as np

from freetoken.bench.replay import lru_miss_rate
from freetoken.bench.routing_trace import RoutingTrace

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
