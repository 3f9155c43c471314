"""Logging: one line per decision worth debugging, with a fixed module prefix.

Loggers are named `ft.<part>` (ft.cache, ft.anchor, ft.experts, ft.sched, ft.server, ...) and
every line reads `ft.<part>: event key=value ...` so a user can paste it into an issue.
"""
from __future__ import annotations

import logging
import sys


def get_logger(part: str) -> logging.Logger:
    return logging.getLogger(f"ft.{part}")


def kv(event: str, **fields: object) -> str:
    """Format `event key=value ...` with stable field order."""
    return event + "".join(f" {k}={v}" for k, v in fields.items())


def setup_logging(level: str = "INFO") -> None:
    root = logging.getLogger("ft")
    if root.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(h)
    root.setLevel(level.upper())
    root.propagate = False
