"""Claude Code (`claude`, Anthropic `/v1/messages?beta=true`).

Seen in the traces: `User-Agent: claude-cli/...`, `X-Claude-Code-Session-Id` shared by the main
agent and its sub-agents, `system[0]` an `x-anthropic-billing-header` fingerprint, a
`cache_control` breakpoint that moves to the last block every request, mid-conversation
`role:"system"` reminders, old thinking sent back with signatures. Apart from those it only
appends; the edits it makes (recorded in tests/data/harness_traces/claude_code/cc_compact.jsonl,
`claude -p`, then `--continue "/compact"`, a further turn and `--resume`):

- compaction: the summary request re-sends the conversation as the latest request had it and
  puts its instructions in a new user turn where that request's reply would go, so it parts
  from the latest prompt at its generation prompt (`turn_start(assistant)`, a predicted cut);
- after compaction, and between sibling sub-agents, only system + tools and the first user
  message's leading `<system-reminder>` context block (date, CLAUDE.md) are kept: `head_end`
  is a predicted cut and the block's end a user break (`user_breaks`);
- a resume (`--continue` / `--resume`) writes the model without its 1M-context suffix, in the
  system text and the Bash tool's co-author line (`unify_model_suffix`, on by default);
- a re-sent sub-agent prompt (the same task to a new agent id) is the earlier sub-agent's first
  prompt token for token: its end (the prompt-end snapshot and kept logits) and its `<think>`
  (a predicted cut) serve it.

Lineage: sub-agents add `X-Claude-Code-Agent-Id`; their parent is the main thread of the same
session id.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken.types.api import Anchor
from harness_adapters.base import (
    HarnessAdapter,
    HarnessRequest,
    anchors_of,
    first_user_text,
    head_hash,
)

AGENT = "x-claude-code-agent-id"  # sent by sub-agents only, beside the parent's session id
REMINDER, REMINDER_END = "<system-reminder>", "</system-reminder>"


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

    def user_breaks(self, body: dict[str, Any]) -> list[int]:
        """The end of the first user message's leading `<system-reminder>` block."""
        text = first_user_text(body)
        end = text.find(REMINDER_END) if text.startswith(REMINDER) else -1
        return [end + len(REMINDER_END)] if end > 0 else []

    def cut_points(self, anchors: Sequence[Anchor], messages: Sequence[dict[str, Any]]
                   ) -> list[int]:
        """The base cuts and, where the generation prompt opens no `<think>` (the base cut
        there serves the next turn; thinking is on in the main thread), its
        `turn_start(assistant)`, where a compaction request parts."""
        out = super().cut_points(anchors, messages)
        turns = anchors_of(anchors, "turn_start")
        last = turns[-1] if turns else None
        if last is not None and last.role == "assistant" and not any(
                a.kind == "think_start" and a.position > last.position for a in anchors):
            out.append(last.position)
        return out

    def detect(self, req: HarnessRequest) -> bool:
        return (req.user_agent.startswith("claude-cli/")
                or "x-claude-code-session-id" in req.headers
                or req.headers.get("x-app") == "cli")
