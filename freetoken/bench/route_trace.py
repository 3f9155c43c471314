"""Replayed trained-router routing for random-weight models. The hooks themselves
(`TraceRouter`, `install_trace`, `install_serve_trace`, `trace_path`) are product code behind
the hidden `ft serve --route-trace`, in freetoken/models/routing_hooks.py, re-exported here for
the benches, with `uniform_trace` (`ft bench decode`'s `random` case, and `ft serve
--route-trace uniform`, which routes the server the same way).
"""
from __future__ import annotations

from freetoken.models.routing_hooks import (  # noqa: F401
    TraceRouter,
    install_serve_trace,
    install_trace,
    trace_path,
    uniform_trace,
)
