"""Replayed trained-router routing for random-weight models. The hooks themselves
(`TraceRouter`, `install_trace`, `install_serve_trace`, `trace_path`) are product code behind
the hidden `ft serve --route-trace`, in freetoken/models/routing_hooks.py, re-exported here for
the benches; this module adds what only benches use: `uniform_trace`, `ft bench decode`'s
`random` case.
"""
from __future__ import annotations

import numpy as np

from freetoken.models.routing_hooks import (  # noqa: F401
    TraceRouter,
    install_serve_trace,
    install_trace,
    trace_path,
)


def uniform_trace(steps: int, layers: int, rows: int, num_experts: int, top_k: int,
                  seed: int = 0) -> np.ndarray:
    """[steps, layers, rows, K] routing drawn uniformly per token: each row of each step picks
    K distinct experts of E at random. Random weights served through real prompts route like
    this (their hit rate equals the cache rate, DESIGN §9), while a random router fed the
    benchmark's own greedy tokens does not, so this is `ft bench decode`'s `random` case."""
    g = np.random.default_rng(seed)
    out = np.empty((steps, layers, rows, top_k), dtype=np.int16)
    for s in range(steps):  # a step at a time: argsort of [L, N, E] keys stays small
        out[s] = np.argsort(g.random((layers, rows, num_experts)), axis=-1)[..., :top_k]
    return out
