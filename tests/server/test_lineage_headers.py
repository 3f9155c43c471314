"""`ft serve` keys sessions and sub-agents from the harness headers (#23 item 1), as the proxy's
adapters do: Claude Code's `X-Claude-Code-Agent-Id` beside its session id, OpenCode's
`x-session-id` / `x-session-affinity` / `x-parent-session-id`, Codex's turn metadata
(`parent_thread_id`) with `prompt_cache_key` as the thread's key. Oracle: the recorded headers
and the cache's own lineage (`Lineage`), which must resolve each sub-agent to its parent.

Bug caught: `ft serve` read only the session id, so a Claude Code sub-agent shared its main
thread's key (each sub-agent request moved the main thread's latest snapshot) and no sub-agent
reached the cache with a parent."""
from __future__ import annotations

import json
from pathlib import Path

from freetoken.cache.lineage import Lineage
from freetoken.server.generation import parent_key_from, session_key_from

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"


def _headers(name: str) -> list[dict[str, str]]:
    return [{k.lower(): v for k, v in json.loads(x)["headers"].items()}
            for x in (TRACES / name).read_text().splitlines()]


def _lineage(keys: list[tuple[str | None, str | None]]) -> Lineage:
    """Requests one after another (each ends before the next), as the scheduler begins them."""
    lin = Lineage()
    for key, parent in keys:
        assert key is not None
        lin.begin(key, parent)
        lin.end(key)
    return lin


def test_claude_code_sub_agents_are_their_own_sessions_naming_the_main_thread() -> None:
    hs = _headers("claude_code/cc_try1.jsonl")
    keys = [(session_key_from(h), parent_key_from(h)) for h in hs]
    sid = hs[0]["x-claude-code-session-id"]
    subs = [k for k, h in zip(keys, hs) if "x-claude-code-agent-id" in h]
    assert len(subs) == 4 and len({k for k, _ in subs}) == 2  # two agents, two turns each
    assert all(k != sid and p == sid for k, p in subs)
    assert all(k == (sid, None) for k, h in zip(keys, hs) if "x-claude-code-agent-id" not in h)
    lin = _lineage(keys)
    assert all(lin.sessions[k].parent == sid and lin.sessions[k].declared for k, _ in subs)


def test_opencode_parent_header_and_affinity_alone() -> None:
    hs = _headers("opencode/oc_try1.jsonl")
    keys = [(session_key_from(h), parent_key_from(h)) for h in hs]
    main = hs[0]["x-session-id"]
    subs = [k for k, _ in keys if k != main]
    assert len(set(subs)) == 2 and all(p == main for k, p in keys if k != main)
    lin = _lineage(keys)
    assert {lin.sessions[k].parent for k in subs} == {main}
    # a client sending only the affinity header is keyed by it
    only = {"x-session-affinity": "ses_x", "x-parent-session-id": main}
    assert (session_key_from(only), parent_key_from(only)) == ("ses_x", main)


def test_codex_spawned_thread_names_its_parent_in_the_turn_metadata() -> None:
    h = _headers("codex/codex_responses.jsonl")[0]
    meta = json.loads(h["x-codex-turn-metadata"])
    root = meta["thread_id"]
    assert parent_key_from(h) is None
    child = dict(h, **{"x-codex-turn-metadata": json.dumps(
        dict(meta, thread_id="child", parent_thread_id=root)), "x-session-id": "child"})
    assert parent_key_from(child) == root
    # the Responses route keys a thread by its prompt_cache_key (the thread id) as x-session-id
    lin = _lineage([(root, None), (session_key_from(child), parent_key_from(child))])
    assert lin.sessions["child"].parent == root and lin.waiting_on_children(root)
    assert parent_key_from(dict(h, **{"x-codex-turn-metadata": "{oops"})) is None


def test_the_proxy_passes_the_lineage_headers_to_its_upstream() -> None:
    """API mode: an `ft serve` behind `ft agent-proxy` sees what the harness sent (bug caught:
    the agent id and parent headers were dropped, so its cache had no sub-agents)."""
    import httpx

    from freetoken.proxy.upstream import Upstream

    up = Upstream("http://x", "openai", httpx.AsyncClient(), api_key="k")
    for h in (*_headers("claude_code/cc_try1.jsonl"), *_headers("opencode/oc_try1.jsonl")):
        out = {k: v.decode("latin-1") if isinstance(v, bytes) else v
               for k, v in up.headers(h, "openai").items()}
        assert (session_key_from(out), parent_key_from(out)) == (session_key_from(h),
                                                                 parent_key_from(h))
