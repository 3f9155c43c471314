"""Replays the recorded harness traffic through the adapters and the session store with the real
Qwen3 template, the way the native proxy sees it: per request the rendered ids, anchors,
predicted cut points, the `system_block` anchors of the adapter's head breaks and the edit
point against the session's previous request."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from freetoken.chat import (
    ChatTokenizer,
    anthropic_to_template,
    openai_to_template,
    qwen3_tokenizer_dir,
)
from freetoken.proxy.heads import HeadBreaks
from freetoken.proxy.sessions import EditPoint, SessionStore
from harness_adapters import HarnessRequest, detect_adapter
from harness_adapters.base import first_user_text, system_text

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"
# chat-shaped traces (Anthropic messages, OpenAI chat); Codex's Responses session is replayed by
# tests/chat/test_responses_map.py and tests/e2e/test_codex_replay_engine.py
FILES = sorted(f for f in TRACES.glob("*/*.jsonl") if f.parent.name != "codex")
EXPECTED = {"claude_code": "claude_code", "opencode": "opencode", "openclaw": "openclaw",
            "mini_swe_agent": "swe_agent"}


@lru_cache(maxsize=1)
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen3_tokenizer_dir())


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def harness_request(rec: dict) -> HarnessRequest:
    api = "anthropic" if rec["path"].startswith("/v1/messages") else "openai"
    return HarnessRequest(api, rec["path"], {k.lower(): v for k, v in rec["headers"].items()},
                          rec["body"])


@dataclass
class Step:
    seq: int
    adapter: str
    session: str
    ids: list[int]
    cuts: list[int]
    anchors: list
    anchors_prev: list  # the session's previous request's anchors (edit blocks)
    edit: EditPoint
    fired: dict[str, int]


def replay(path: Path, seqs: set[int] | None = None,
           edit: Callable[[dict], dict] | None = None) -> list[Step]:
    """`edit`: applied to each recorded body first (e.g. another working directory)."""
    tok = tokenizer()
    heads = HeadBreaks(tok)
    store = SessionStore()
    last: dict[str, list] = {}
    out = []
    for rec in records(path):
        if "count_tokens" in rec["path"] or (seqs is not None and rec["seq"] not in seqs):
            continue
        req = harness_request({**rec, "body": edit(rec["body"])} if edit else rec)
        ad = detect_adapter(req)
        body, fired = ad.normalise(req)
        nreq = HarnessRequest(req.api, req.path, req.headers, body)
        key = ad.session_key(nreq)
        ti = (anthropic_to_template if req.api == "anthropic" else openai_to_template)(body)
        prompt = tok.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking)
        cuts = ad.cut_points(prompt.anchors, ti.messages)
        # as TurnEngine: the head and user breaks become system_block anchors after the cuts
        # are chosen
        anchors = heads.anchors(prompt.anchors, system_text(body), ad.head_breaks(body),
                                prompt.input_ids)
        anchors = heads.anchors(anchors, first_user_text(body), ad.user_breaks(body),
                                prompt.input_ids)
        prev_anchors = last.get(key, [])
        last[key] = anchors
        ep = store.observe_tokens(key, prompt.input_ids, anchors, cuts)
        out.append(Step(rec["seq"], ad.name, key, prompt.input_ids, cuts, anchors,
                        prev_anchors, ep, fired))
    return out


def hit_rates(steps: dict[Path, list[Step]] | None = None) -> dict[str, dict[str, int]]:
    """Per harness: requests, edits, predicted hits, appends."""
    rates: dict[str, dict[str, int]] = {}
    for f in FILES:
        for s in (steps[f] if steps is not None else replay(f)):
            r = rates.setdefault(s.adapter, {"requests": 0, "edits": 0, "hits": 0,
                                             "appends": 0})
            r["requests"] += 1
            r["edits"] += s.edit.kind == "edit"
            r["hits"] += s.edit.predicted_hit is True
            r["appends"] += s.edit.kind == "append"
    return rates


if __name__ == "__main__":
    import time
    t = time.time()
    for f in FILES:
        for s in replay(f):
            print(f.stem, s.seq, s.adapter, s.session[-20:], len(s.ids), s.cuts, s.edit, s.fired)
    print(hit_rates(), time.time() - t)
