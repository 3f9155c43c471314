"""Workload registry: build any of W1–W4 by name at a scale."""
from __future__ import annotations

from collections.abc import Callable

from workloads.spec import Scale, Workload
from workloads.w1 import build_w1
from workloads.w2 import build_w2
from workloads.w3 import build_w3
from workloads.w4 import build_w4

BUILDERS: dict[str, Callable[[Scale, int], Workload]] = {
    "W1": build_w1, "W2": build_w2, "W3": build_w3, "W4": build_w4}
NAMES = tuple(BUILDERS)


def build_workload(name: str, scale: Scale = "full", seed: int = 0) -> Workload:
    """The deterministic workload `name` (W1..W4) at `scale`; same arguments, same bytes."""
    try:
        return BUILDERS[name.upper()](scale, seed)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)}") from None
