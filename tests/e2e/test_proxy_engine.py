"""End to end: harness traffic -> `ft agent-proxy` (native) -> `ft serve` on a tiny hybrid
model (3 linear-attention layers + 1 full). Replaying each recorded session, the engine reuses
exactly what the edit points allow: for every request, the cached tokens equal the deepest
state snapshot (at the anchors and predicted cut points the semantic policy chose for earlier
requests) at or below the longest common prefix with an earlier prompt. That reference is
computed here from the proxy's own rendering, independently of the engine."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "proxy"))
from server_helpers import Server
from trace_replay import FILES, records, replay

from freetoken.cache.policy import create_policy
from freetoken.chat import ChatTokenizer
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.envs import FT_PROXY_E2E_ALL
from freetoken.models.loader import load_model
from freetoken.proxy.app import create_proxy_app
from freetoken.proxy.config import ProxyConfig
from freetoken.server import create_app
from freetoken.types.api import Anchor

HOP = {"host", "content-length", "connection", "accept-encoding"}
SUBSET = {"oc_prune": {1, 2, 3, 13}}  # 144k-token requests otherwise; 3 -> 13 is the prune edit
# One trace per edit pattern by default (Claude Code appends + sub-agents, its compaction,
# resume and re-sent sub-agents, OpenClaw's rolling context, mini-swe-agent); all with
# FT_PROXY_E2E_ALL=1 (about 160 s on the dev machine,
# most of it prefilling OpenCode's 59k-token prune request on CPU).
DEFAULT = {"cc_try1", "cc_compact", "ocl_try1", "mini_tool"}
PATHS = [f for f in FILES if f.stem in DEFAULT or FT_PROXY_E2E_ALL.get()]


@pytest.fixture(scope="module")
def stack(tiny_chat_dir: Path, tmp_path_factory):
    model = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(tiny_chat_dir)
    state = {}

    def fresh(metrics: Path):
        """A new engine (empty caches; state slots enough for no eviction) behind a proxy."""
        for s in state.values():
            s.stop() if hasattr(s, "stop") else s.shutdown()
        core = EngineCore(model, tok.eos_token_ids, kv_tokens=200000, state_slots=200,
                          max_running=4, chunk_tokens=1024, max_context=262144)
        engine = AsyncEngine(core, tiny_chat_dir, "tiny")
        serve = Server(create_app(engine, tok, api_key=None, served_model_names=["tiny"],
                                  parser_family="qwen3_5_moe"))
        cfg = ProxyConfig(native_url=serve.url, caps={"*": 3}, metrics_path=str(metrics))
        proxy = Server(create_proxy_app(cfg, tok, "qwen3_5_moe"))
        state.update(engine=engine, serve=serve, proxy=proxy)
        return proxy

    yield fresh
    for s in state.values():
        s.stop() if hasattr(s, "stop") else s.shutdown()


def _expected_cached(history: list[tuple[list[int], list[int]]], ids: list[int]) -> int:
    """Deepest snapshot <= LCP over earlier prompts, at most `len(ids) - 1` unless the logits
    there are kept; `history` holds (ids, snapshot positions). Each earlier prompt also has
    a snapshot at its end, and its logits kept at its last two positions (cache/logits.py:
    a resend, or one a token shorter, feeds nothing)."""
    best = 0
    for prev, snaps in history:
        n = 0
        for a, b in zip(prev, ids):
            if a != b:
                break
            n += 1
        kept = {len(prev) - 1, len(prev)}
        best = max([best] + [p for p in [*snaps, len(prev)] if p <= n
                             and (p < len(ids) or (p == len(ids) and p in kept))])
    return best


@pytest.mark.parametrize("path", PATHS, ids=[f.stem for f in PATHS])
def test_replay_reuses_exactly_what_the_edit_points_allow(stack, path: Path, tmp_path) -> None:
    proxy = stack(tmp_path / "m.jsonl")
    seqs = SUBSET.get(path.stem)
    with httpx.Client(base_url=proxy.url, timeout=300) as c:
        for rec in records(path):
            if seqs is not None and rec["seq"] not in seqs:
                continue
            headers = {k: v for k, v in rec["headers"].items() if k.lower() not in HOP}
            r = c.request(rec["method"], rec["path"], json=rec["body"], headers=headers)
            assert r.status_code == 200, r.text[:300]
            assert '"error"' not in r.text[:2000] or "count_tokens" in rec["path"]
    got = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    got = [g for g in got if "count_tokens" not in g["path"]]
    steps = replay(path, seqs)
    assert len(got) == len(steps)
    policy = create_policy("semantic")
    history: list[tuple[list[int], list[int]]] = []
    by_session: dict[str, list[int]] = {}
    prev_cuts: dict[str, list[int]] = {}  # each session's previous request's predicted cuts
    for g, s in zip(got, steps):
        assert g["prompt_tokens"] == len(s.ids) and g["predicted_cuts"] == s.cuts
        assert g["edit_kind"] == s.edit.kind and g["edit_position"] == s.edit.position
        want = _expected_cached(history, s.ids)
        assert g["cached_tokens"] == want, (s.seq, g["cached_tokens"], want, s.edit)
        assert g["recomputed_tokens"] == len(s.ids) - want
        if s.edit.kind == "edit":  # the reuse reaches the block the edit falls in
            a = max((a for a in s.anchors_prev if a.position <= s.edit.position),
                    key=lambda a: a.position)
            # a predicted turn-start cut is snapshotted one token in, past the `<|im_start|>`
            # every turn shares (cache/policy.py)
            one_in = (a.kind == "turn_start" and a.position in prev_cuts.get(s.session, ())
                      and a.position + 1 <= s.edit.position)
            # ... or past it, where another session sent this prompt before (cc_compact's
            # re-sent sub-agents repeat seq 6/7 token for token: `want` covers it whole)
            assert want == a.position + one_in or (want > a.position and any(
                prev[:want] == s.ids[:want] for prev, _ in history))
        anchors = [Anchor(a.position, a.kind, a.role, a.position in s.cuts) for a in s.anchors]
        history.append((s.ids, [p for p, _ in policy.positions(len(s.ids), anchors)]))
        by_session.setdefault(g["session"], []).append(g["cached_tokens"])
        prev_cuts[s.session] = s.cuts
    for cached in by_session.values():  # turn over turn, each session reuses more
        assert cached == sorted(cached), cached
