"""Codex CLI (`codex`, OpenAI Responses API `/v1/responses`, streaming; 0.171 speaks nothing
else). The proxy turns its requests into chat requests (`freetoken/proxy/responses.py`) with the
original headers, which is what this adapter sees.

Seen in the recorded session (tests/data/harness_traces/codex): `originator: codex_exec` (or
`codex_cli_rs`), `User-Agent: codex_exec/0.171.0 ...`, headers `session-id` / `thread-id` and
`x-codex-turn-metadata` (JSON naming session, thread and turn), `prompt_cache_key` = the session
id (carried as `x-session-id`). Every request re-sends the whole history as input items
(developer instructions, the environment context as a user message, then reasoning, messages,
function calls and their outputs): it only appends, so the cuts are the base ones (`head_end`
for sub-agents sharing system + tools, the generation prompt's think block). Sub-agents get
their own thread id, hence their own session key, and name their parent's thread in the turn
metadata (`parent_thread_id`, as `generic.codex_lineage` reads it): the parent key.
"""
from __future__ import annotations

import json

from harness_adapters.base import HarnessAdapter, HarnessRequest, head_hash
from harness_adapters.generic import codex_lineage


class Codex(HarnessAdapter):
    name = "codex"
    session_headers = ("thread-id", "session-id", "x-session-id")

    def detect(self, req: HarnessRequest) -> bool:
        h = req.headers
        return (str(h.get("originator", "")).startswith("codex")
                or req.user_agent.startswith(("codex_", "codex/"))
                or "x-codex-turn-metadata" in h)

    def session_key(self, req: HarnessRequest) -> str:
        key = None
        meta = req.headers.get("x-codex-turn-metadata")
        if meta:
            try:
                m = json.loads(meta)
                key = m.get("thread_id") or m.get("session_id")
            except (ValueError, AttributeError):
                key = None
        key = key or next((req.headers[h] for h in self.session_headers if req.headers.get(h)),
                          None)
        if key:
            return f"{self.name}:{str(key)[:128]}:{head_hash(req.body)}"
        return f"{self.name}:{head_hash(req.body)}"

    def parent_key(self, req: HarnessRequest) -> str | None:
        """The parent thread the turn metadata names (a spawned sub-agent's), as the prefix
        of its session key (`codex:THREAD:`); None for a top-level thread."""
        _, parent = codex_lineage(req)
        return f"{self.name}:{parent}:" if parent else None
