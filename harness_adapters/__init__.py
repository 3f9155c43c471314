"""Harness adapters: one module per harness behind `HarnessAdapter` (see base.py for the
contract). `detect_adapter(req)` returns the first adapter that claims the request; `generic`
claims everything."""
from __future__ import annotations

from harness_adapters.base import HarnessAdapter, HarnessRequest
from harness_adapters.claude_code import ClaudeCode
from harness_adapters.codex import Codex
from harness_adapters.generic import Generic
from harness_adapters.openclaw import OpenClaw
from harness_adapters.opencode import OpenCode
from harness_adapters.swe_agent import SWEAgent

ADAPTERS: tuple[HarnessAdapter, ...] = (ClaudeCode(), Codex(), OpenCode(), OpenClaw(),
                                        SWEAgent(), Generic())
BY_NAME = {a.name: a for a in ADAPTERS}


def detect_adapter(req: HarnessRequest, force: str | None = None) -> HarnessAdapter:
    if force:
        return BY_NAME[force]
    return next(a for a in ADAPTERS if a.detect(req))


__all__ = ["ADAPTERS", "BY_NAME", "HarnessAdapter", "HarnessRequest", "detect_adapter"]
