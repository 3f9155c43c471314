"""Any other client: header session ids where sent (Claude Code's and OpenCode's names), else a
hash of the stable head; `head_end` as the predicted cut."""
from __future__ import annotations

from harness_adapters.base import HarnessAdapter, HarnessRequest


class Generic(HarnessAdapter):
    name = "generic"
    session_headers = ("x-claude-code-session-id", "x-session-id", "x-session-affinity")

    def detect(self, req: HarnessRequest) -> bool:
        return True
