"""OpenCode (`opencode`, OpenAI chat through the AI SDK, streaming).

Seen in the traces: `User-Agent: opencode/...`, `x-session-id` / `x-session-affinity` (one per
session; each sub-agent has its own, the title request shares its parent's), reasoning sent back
as `reasoning_content`. Edits: prune (`"compaction": {"prune": true}`) replaces the oldest tool
outputs with `[Old tool result content cleared]`, so the next request diverges at the oldest
tool result not yet cleared; compaction keeps system + tools. Predicted cuts: `head_end` and
the start of the oldest uncleared tool result.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken.types.api import Anchor
from harness_adapters.base import HarnessAdapter, HarnessRequest, anchors_of, text_of

PRUNED = "[Old tool result content cleared]"


class OpenCode(HarnessAdapter):
    name = "opencode"
    session_headers = ("x-session-id", "x-session-affinity")
    parent_headers = ("x-parent-session-id",)  # a sub-agent session names its parent's id
    sub_agent_drops = ("task", "todowrite")  # sub-agents cannot spawn or keep the todo list
    head_marks = ("<env>",)  # working directory, date

    def detect(self, req: HarnessRequest) -> bool:
        return req.user_agent.startswith("opencode/") or "x-session-affinity" in req.headers

    def cut_points(self, anchors: Sequence[Anchor], messages: Sequence[dict[str, Any]]
                   ) -> list[int]:
        out = super().cut_points(anchors, messages)
        tools = [m for m in messages if m.get("role") == "tool"]
        results = anchors_of(anchors, "tool_result_start")
        # tool messages and <tool_response> anchors pair up in order (one block per message)
        for i, m in enumerate(tools):
            if text_of(m.get("content")).strip() != PRUNED:
                if i < len(results) and len(results) == len(tools):
                    out.append(results[i].position)
                break
        return out
