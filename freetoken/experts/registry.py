"""Expert backends by name: `create_backend(name, layer, runtime)` builds the complete
`ExpertBackend` (experts/base.py) of MoE layer `layer` from the parts the runtime owns
(experts/runtime.py: the slot cache, the host store, the counters, the CPU threads, the
streamer, `hybrid`'s fetch rule, `auto`'s guard). One class per strategy; a new backend is one
entry here.

- `fused`: the layer's banks resident on the compute device (`runtime.fused_banks(layer)`).
- `offload`: every miss fetched (experts/offload.py).
- `cpu`, `hybrid`: misses split with the CPU branch by a fetch rule (experts/split.py).
- `auto`: the fastest of offload, hybrid and cpu, timed on the live decode steps by its guard
  (experts/auto.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from freetoken.experts.auto import AutoExperts
from freetoken.experts.base import ExpertBackend
from freetoken.experts.fused import FusedExperts
from freetoken.experts.offload import OffloadExperts
from freetoken.experts.split import CpuSplitExperts, FixedRule


def _fused(layer: int, rt: Any) -> ExpertBackend:
    return FusedExperts.from_banks(*rt.fused_banks(layer))


def _offload(layer: int, rt: Any) -> ExpertBackend:
    return OffloadExperts(layer, rt.cache, rt.store, rt.counters, rt.cpu_threads, rt.streamer)


def _cpu(layer: int, rt: Any) -> ExpertBackend:
    return CpuSplitExperts("cpu", layer, rt.cache, rt.store, rt.counters, FixedRule(0),
                           rt.cpu_threads, rt.streamer)


def _hybrid(layer: int, rt: Any) -> ExpertBackend:
    return CpuSplitExperts("hybrid", layer, rt.cache, rt.store, rt.counters, rt.q_rule,
                           rt.cpu_threads, rt.streamer)


def _auto(layer: int, rt: Any) -> ExpertBackend:
    return AutoExperts(layer, rt.cache, rt.store, rt.counters, rt.guard, rt.cpu_threads,
                       rt.streamer)


_REGISTRY: dict[str, Callable[[int, Any], ExpertBackend]] = {
    "fused": _fused, "offload": _offload, "cpu": _cpu, "hybrid": _hybrid, "auto": _auto,
}


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def create_backend(name: str, layer: int, runtime: Any = None) -> ExpertBackend:
    """The `name` backend of MoE layer `layer`, complete, from `runtime`'s parts."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown expert backend {name!r}; known: "
                         f"{', '.join(_REGISTRY)}") from None
    return factory(layer, runtime)
