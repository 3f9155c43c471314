"""W1–W4 agent workloads and their replay runner (`ft bench workload`).

    from workloads import build_workload, run_workload, write_report
    w = build_workload("W3", scale="tiny")
    result = run_workload(w, "http://127.0.0.1:8000", api="anthropic")
"""
from workloads.client import TurnResult
from workloads.registry import NAMES, build_workload
from workloads.report import write_report
from workloads.runner import (
           WorkloadResult,
           request_body,
           run_workload,
           run_workload_async,
           summarize,
)
from workloads.spec import Turn, Workload

__all__ = ["NAMES", "Turn", "TurnResult", "Workload", "WorkloadResult", "build_workload",
           "request_body", "run_workload", "run_workload_async", "summarize", "write_report"]
