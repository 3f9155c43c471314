"""Claude Code (`claude`, Anthropic `/v1/messages?beta=true`).

Seen in the traces: `User-Agent: claude-cli/...`, `X-Claude-Code-Session-Id` shared by the main
agent and its sub-agents, `system[0]` an `x-anthropic-billing-header` fingerprint, a
`cache_control` breakpoint that moves to the last block every request, mid-conversation
`role:"system"` reminders, old thinking sent back with signatures. Apart from those it only
appends, so the edits it makes are compaction and sub-agents (both keep system + tools):
`head_end` is the predicted cut.
"""
from __future__ import annotations

from harness_adapters.base import HarnessAdapter, HarnessRequest


class ClaudeCode(HarnessAdapter):
    name = "claude_code"
    session_headers = ("x-claude-code-session-id",)
    head_marks = ("# Environment\n",)  # working directory, git state, model

    def detect(self, req: HarnessRequest) -> bool:
        return (req.user_agent.startswith("claude-cli/")
                or "x-claude-code-session-id" in req.headers
                or req.headers.get("x-app") == "cli")
