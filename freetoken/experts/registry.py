"""Expert backends by name: `create_backend(name, layer, **parts)` builds the `ExpertBackend`
(freetoken/layers/expert_backend.py) of one MoE layer. A new backend is one entry here.

- `fused`: the layer's banks resident on the compute device (`banks=(gate_up, down)`).
- `offload`, `cpu`, `hybrid`, `auto`: views of the shared slot cache (`cache`, `store`,
  `stats`) that differ in how many of a step's misses they fetch (`num_fetch`, `fixed_fetch`;
  see SlotExperts).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from freetoken.experts.backends import SlotExperts
from freetoken.layers.expert_backend import ExpertBackend
from freetoken.layers.moe import FusedExperts


def _fused(layer: int, *, banks: tuple[torch.Tensor, torch.Tensor], **_: Any) -> ExpertBackend:
    fe = FusedExperts(1, 1, 1)
    gate_up, down = banks
    fe.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    fe.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return fe


def _slot(name: str) -> Callable[..., ExpertBackend]:
    def make(layer: int, *, cache, store, stats, num_fetch: Callable[[int], int],
             fixed_fetch: int | None = None, cpu_threads: int | None = None, guard=None,
             **_: Any) -> ExpertBackend:
        e = SlotExperts(layer, cache, store, stats, num_fetch, name, fixed_fetch, cpu_threads)
        e.guard = guard
        return e

    return make


_REGISTRY: dict[str, Callable[..., ExpertBackend]] = {
    "fused": _fused,
    **{n: _slot(n) for n in ("offload", "cpu", "hybrid", "auto")},
}


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create_backend(name: str, layer: int, **parts: Any) -> ExpertBackend:
    """The `name` backend of MoE layer `layer` from its parts (see the module docstring)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown expert backend {name!r}; known: "
                         f"{', '.join(_REGISTRY)}") from None
    return factory(layer, **parts)
