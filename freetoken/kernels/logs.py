"""The kernels' log lines, in the project's format (`ft.<part>: event key=value ...`, as
freetoken/log.py writes them) through the standard library alone: kernels import nothing of
freetoken but its envs."""
from __future__ import annotations

import logging


def get_logger(part: str) -> logging.Logger:
    return logging.getLogger(f"ft.{part}")


def kv(event: str, **fields: object) -> str:
    return event + "".join(f" {k}={v}" for k, v in fields.items())
