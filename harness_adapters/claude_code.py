"""Claude Code (`claude`, Anthropic `/v1/messages?beta=true`).

Seen in the traces: `User-Agent: claude-cli/...`, `X-Claude-Code-Session-Id` shared by the main
agent and its sub-agents, `system[0]` an `x-anthropic-billing-header` fingerprint, a
`cache_control` breakpoint that moves to the last block every request, mid-conversation
`role:"system"` reminders, old thinking sent back with signatures. Apart from those it only
appends, so the edits it makes are compaction and sub-agents (both keep system + tools):
`head_end` is the predicted cut. Lineage: sub-agents add `X-Claude-Code-Agent-Id`; their
parent is the main thread of the same session id.
"""
from __future__ import annotations

from harness_adapters.base import HarnessAdapter, HarnessRequest, head_hash

AGENT = "x-claude-code-agent-id"  # sent by sub-agents only, beside the parent's session id


class ClaudeCode(HarnessAdapter):
    name = "claude_code"
    session_headers = ("x-claude-code-session-id",)
    head_marks = ("# Environment\n",)  # working directory, git state, model
    # a resume may write the model without its 1M-context suffix (#23): unify both spellings
    default_steps = (*HarnessAdapter.default_steps, "unify_model_suffix")

    def session_key(self, req: HarnessRequest) -> str:
        sid, agent = req.headers.get(self.session_headers[0]), req.headers.get(AGENT)
        if sid and agent:  # a sub-agent: its own key, apart from its parent's prefix
            return f"{self.name}:{str(sid)[:128]}/{str(agent)[:64]}:{head_hash(req.body)}"
        return super().session_key(req)

    def parent_key(self, req: HarnessRequest) -> str | None:
        sid, agent = req.headers.get(self.session_headers[0]), req.headers.get(AGENT)
        return f"{self.name}:{str(sid)[:128]}:" if sid and agent else None

    def detect(self, req: HarnessRequest) -> bool:
        return (req.user_agent.startswith("claude-cli/")
                or "x-claude-code-session-id" in req.headers
                or req.headers.get("x-app") == "cli")
