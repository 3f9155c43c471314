"""OpenClaw (`openclaw agent`, OpenAI chat via the OpenAI JS SDK, or Anthropic via undici).

Seen in the traces: no session header; every request ends with a user message
`<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> ...` that the next request removes before appending the
new turns and a fresh copy; user messages carry a wall-clock stamp fixed once written; the
system prompt starts with `<!-- openclaw:attempt:`. Predicted cuts: the start of the trailing
internal-context turn (every next request diverges there) and `head_end`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken.types.api import Anchor
from harness_adapters.base import (
    HarnessAdapter,
    HarnessRequest,
    anchors_of,
    system_text,
    text_of,
)

CONTEXT_TAG = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"


class OpenClaw(HarnessAdapter):
    name = "openclaw"
    # directory; date; sibling sub-agents part at their label (`## Session Context\n- Label:`)
    head_marks = ("## Workspace\n", "<!-- openclaw:attempt:DYNAMIC -->", "## Session Context\n")
    # an announce turn drops a deferred tool (the list after this line, ~540 chars in: #23)
    head_line_ends = ("Available deferred-schema tools:",)

    def detect(self, req: HarnessRequest) -> bool:
        if system_text(req.body).startswith("<!-- openclaw:"):
            return True
        msgs = req.body.get("messages") or []
        return bool(msgs) and isinstance(msgs[-1], dict) and text_of(
            msgs[-1].get("content")).startswith(CONTEXT_TAG)

    def cut_points(self, anchors: Sequence[Anchor], messages: Sequence[dict[str, Any]]
                   ) -> list[int]:
        out = super().cut_points(anchors, messages)
        if messages and messages[-1].get("role") == "user" and text_of(
                messages[-1].get("content")).startswith(CONTEXT_TAG):
            users = anchors_of(anchors, "turn_start", "user")
            if users:
                out.append(users[-1].position)  # the trailing message is the last user turn
        return out
