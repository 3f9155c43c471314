"""The workloads logger (`ft.workload`)."""
from __future__ import annotations

from freetoken.log import get_logger

log = get_logger("workload")
