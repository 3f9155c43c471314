"""SWE-agent and mini-swe-agent (OpenAI chat through litellm, not streamed).

Seen in the traces: `User-Agent: OpenAI/Python`, no session header, no `max_tokens`, litellm
flipping content between a string and `[{"type": "text"}]`; mini-swe-agent's system prompt
("...interact with a computer") and its ```` ```mswea_bash_command```` blocks (text protocol) or
tool calls (tool protocol). mini-swe-agent only appends, except after a reply it cannot parse
(no or a malformed tool call, a `FormatError`): it drops the reply and appends its error as a
user turn, so the next prompt parts from this one inside the generation prompt, at its
`turn_start(assistant)` (seen with the demo model behind `ft agent-proxy`: every edit was
there, 2 tokens before the previous prompt's end). SWE-agent's `LastNObservations`
replaces every observation except the first and the last `keep_last` with
`Old environment output: (N lines omitted)`: on the next step the observation that falls out of
the kept window is the edit point. Observations are tool results (tool protocol) or user turns
(text protocol). Predicted cuts: `head_end`, the start of that observation, and the generation
prompt's `turn_start(assistant)`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken.types.api import Anchor
from harness_adapters.base import HarnessAdapter, HarnessRequest, anchors_of, system_text

KEEP_LAST = 5  # SWE-agent's default `n` for LastNObservations


class SWEAgent(HarnessAdapter):
    name = "swe_agent"
    keep_last = KEEP_LAST

    def detect(self, req: HarnessRequest) -> bool:
        sys = system_text(req.body)
        return ("interact with a computer" in sys or "mswea_bash_command" in sys
                or "SWE-agent" in sys)

    def cut_points(self, anchors: Sequence[Anchor], messages: Sequence[dict[str, Any]]
                   ) -> list[int]:
        out = super().cut_points(anchors, messages)
        results = anchors_of(anchors, "tool_result_start")
        if not results:  # text protocol: observations are the user turns after the task
            results = anchors_of(anchors, "turn_start", "user")[1:]
        # after the next observation is appended, the one now `keep_last` from the end (and
        # not the first) is the first to be elided
        k = len(results) - self.keep_last
        if k >= 1:
            out.append(results[k].position)
        if anchors and anchors[-1].kind == "turn_start" and anchors[-1].role == "assistant":
            out.append(anchors[-1].position)  # the generation prompt: a dropped reply parts here
        return out
