"""Any other client: header session ids where sent (Claude Code's and OpenCode's names, Codex's
turn metadata and `prompt_cache_key`), else a hash of the stable head; `head_end` as the
predicted cut."""
from __future__ import annotations

import json

from harness_adapters.base import HarnessAdapter, HarnessRequest, head_hash

CODEX_META = "x-codex-turn-metadata"  # JSON: session_id / thread_id, parent thread if spawned


def codex_lineage(req: HarnessRequest) -> tuple[str | None, str | None]:
    """Codex's (thread, parent thread): the turn metadata header (also echoed in the body's
    `client_metadata`), else the body's `prompt_cache_key` as the thread."""
    raw = req.headers.get(CODEX_META)
    meta = req.body.get("client_metadata")
    if raw is None and isinstance(meta, dict):
        raw = meta.get(CODEX_META)
    info: dict = {}
    if isinstance(raw, str):
        try:
            got = json.loads(raw)
        except ValueError:
            got = None
        info = got if isinstance(got, dict) else {}
    thread = info.get("thread_id") or info.get("session_id") or req.body.get("prompt_cache_key")
    parent = info.get("parent_thread_id") or info.get("parent_session_id")
    return (str(thread)[:128] if thread else None), (str(parent)[:128] if parent else None)


class Generic(HarnessAdapter):
    name = "generic"
    session_headers = ("x-claude-code-session-id", "x-session-id", "x-session-affinity")
    parent_headers = ("x-parent-session-id",)

    def detect(self, req: HarnessRequest) -> bool:
        return True

    def session_key(self, req: HarnessRequest) -> str:
        thread, _ = codex_lineage(req)
        if thread:
            return f"codex:{thread}:{head_hash(req.body)}"
        return super().session_key(req)

    def parent_key(self, req: HarnessRequest) -> str | None:
        _, parent = codex_lineage(req)
        return f"codex:{parent}:" if parent else super().parent_key(req)
