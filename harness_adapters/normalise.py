"""The normalisation pipeline: small named steps that remove what needlessly breaks prefix reuse.

Each step is a pure function `(body, api, ctx) -> (body, count)` on a deep copy of the request
body; `count` is how many places it changed (0: did not fire). Steps are switchable by name
(`ft agent-proxy --step NAME=on|off`); each harness adapter picks its defaults. `changes_prompt`
says whether the step can change the text the model is asked (True: off by default everywhere;
the proxy logs every step that fired, one line per request).

Steps (changes the prompt? / what):
- strip_billing_header (no: a per-session fingerprint, no meaning): drop Claude Code's
  `x-anthropic-billing-header: ...` system block.
- drop_cache_control (no: not tokens): remove `cache_control` keys.
- drop_metadata (no: not tokens): remove `metadata` (user/device ids).
- canonical_content (no: renders the same): a single text block/part as a plain string.
- stable_tool_ids (no: ids are not rendered): give id-less tool calls a deterministic id.
- system_in_place (only when folding): mid-conversation system messages stay in place; when the
  template forbids them there, they become a user turn in the same place.
- unify_model_suffix (yes; on for Claude Code): `claude-...[1m]` -> `claude-...`,
  `model named X (1M context)` -> `model named X` and `Claude X (1M context)` -> `Claude X` in
  system text and tool descriptions (a resume drops them: the Bash tool's co-author line).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


BILLING_PREFIX = "x-anthropic-billing-header"
# `claude-X[1m]` and the `(1M context)` after the model's name: Claude Code writes both when a
# session runs with the 1M context window and drops them on resume (#23; recorded in
# tests/data/harness_traces/claude_code/cc_compact.jsonl: the system text's "model named Opus
# 4.8 (1M context)" and "claude-opus-4-8[1m]", and the Bash tool's "Co-Authored-By: Claude
# Opus 4.8 (1M context) <noreply@...>")
_MODEL_SUFFIX = re.compile(r"(claude-[a-z0-9.\-]+)\[1m\]"
                           r"|((?:model named|Claude) [^\n(<]{1,80}?) \(\d+[KkMm] context\)")

StepFn = Callable[[dict, str, dict], int]


@dataclass(frozen=True)
class Step:
    name: str
    fn: StepFn
    changes_prompt: bool
    doc: str


def _strip_billing(body: dict, api: str, ctx: dict) -> int:
    sys = body.get("system")
    if api != "anthropic" or not isinstance(sys, list):
        return 0
    keep = [b for b in sys if not (isinstance(b, dict)
                                   and str(b.get("text", "")).startswith(BILLING_PREFIX))]
    n = len(sys) - len(keep)
    if n:
        body["system"] = keep
    return n


def _pop(d: Any, key: str) -> int:
    return int(isinstance(d, dict) and d.pop(key, None) is not None)


def _drop_cache_control(body: dict, api: str, ctx: dict) -> int:
    """Only where the APIs allow `cache_control` (system blocks, messages, content blocks and
    the blocks inside tool results, tools): tool schemas are never walked."""
    n = 0
    for t in body.get("tools") or []:
        n += _pop(t, "cache_control")
    sys = body.get("system")
    for b in sys if isinstance(sys, list) else []:
        n += _pop(b, "cache_control")
    for m in body.get("messages") or []:
        n += _pop(m, "cache_control")
        content = m.get("content") if isinstance(m, dict) else None
        for b in content if isinstance(content, list) else []:
            n += _pop(b, "cache_control")
            inner = b.get("content") if isinstance(b, dict) else None
            for ib in inner if isinstance(inner, list) else []:
                n += _pop(ib, "cache_control")
    return n


def _drop_metadata(body: dict, api: str, ctx: dict) -> int:
    return int(body.pop("metadata", None) is not None)


def _single_text(content: Any) -> str | None:
    if (isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict)
            and content[0].get("type") == "text" and isinstance(content[0].get("text"), str)
            and set(content[0]) <= {"type", "text"}):
        return str(content[0]["text"])
    return None


def _canonical_content(body: dict, api: str, ctx: dict) -> int:
    n = 0
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        t = _single_text(m.get("content"))
        if t is not None:
            m["content"] = t
            n += 1
        if api == "anthropic" and isinstance(m.get("content"), list):
            for b in m["content"]:
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    t = _single_text(b.get("content"))
                    if t is not None:
                        b["content"] = t
                        n += 1
    return n


def _stable_tool_ids(body: dict, api: str, ctx: dict) -> int:
    n = 0
    for i, m in enumerate(body.get("messages") or []):
        if not isinstance(m, dict):
            continue
        if api == "openai":
            for j, c in enumerate(m.get("tool_calls") or []):
                if isinstance(c, dict) and not c.get("id"):
                    fn = c.get("function") or {}
                    c["id"] = "call_" + digest(i, j, fn.get("name"), fn.get("arguments"))
                    n += 1
        elif isinstance(m.get("content"), list):
            for j, b in enumerate(m["content"]):
                if isinstance(b, dict) and b.get("type") == "tool_use" and not b.get("id"):
                    b["id"] = "toolu_" + digest(i, j, b.get("name"), b.get("input"))
                    n += 1
    return n


def _system_in_place(body: dict, api: str, ctx: dict) -> int:
    """Leave mid-conversation system messages where they are (no hoisting); fold them into a
    user turn in place only when the template cannot render them there (`ctx['fold_system']`)."""
    if not ctx.get("fold_system"):
        return 0
    n = 0
    msgs = body.get("messages") or []
    for i, m in enumerate(msgs):
        first = i == 0 and api == "openai"
        if isinstance(m, dict) and m.get("role") in ("system", "developer") and not first:
            m["role"] = "user"
            n += 1
    return n


def _unify_model_suffix(body: dict, api: str, ctx: dict) -> int:
    n = 0

    def sub(s: str) -> str:
        nonlocal n
        out, k = _MODEL_SUFFIX.subn(lambda m: m.group(1) or m.group(2), s)
        n += k
        return out

    sys = body.get("system")
    if isinstance(sys, str):
        body["system"] = sub(sys)
    elif isinstance(sys, list):
        for b in sys:
            if isinstance(b, dict) and isinstance(b.get("text"), str):
                b["text"] = sub(b["text"])
    for t in body.get("tools") or []:
        holder = t.get("function") if isinstance(t.get("function"), dict) else t
        if isinstance(holder.get("description"), str):
            holder["description"] = sub(holder["description"])
    if api == "openai":
        for m in body.get("messages") or []:
            if isinstance(m, dict) and m.get("role") == "system" and isinstance(
                    m.get("content"), str):
                m["content"] = sub(m["content"])
    return n


STEPS: dict[str, Step] = {s.name: s for s in (
    Step("strip_billing_header", _strip_billing, False, "drop x-anthropic-billing-header"),
    Step("drop_cache_control", _drop_cache_control, False, "remove cache_control keys"),
    Step("drop_metadata", _drop_metadata, False, "remove metadata"),
    Step("canonical_content", _canonical_content, False, "single text block -> string"),
    Step("stable_tool_ids", _stable_tool_ids, False, "deterministic ids for id-less calls"),
    Step("system_in_place", _system_in_place, False, "mid-conversation system kept/folded"),
    Step("unify_model_suffix", _unify_model_suffix, True, "claude-X[1m] -> claude-X"),
)}


def run_pipeline(body: dict, api: str, enabled: Mapping[str, bool], fold_system: bool = False,
                 copy: bool = True) -> tuple[dict, dict[str, int]]:
    """Apply the enabled steps in STEPS order to a copy of `body` (to `body` itself when `copy`
    is False: the caller owns a private parse); returns (body, fired)."""
    unknown = set(enabled) - set(STEPS)
    if unknown:
        raise ValueError(f"unknown normalisation steps {sorted(unknown)}; known: {list(STEPS)}")
    out = json.loads(json.dumps(body)) if copy else body  # faster than copy.deepcopy
    ctx = {"fold_system": fold_system}
    fired: dict[str, int] = {}
    for name, step in STEPS.items():
        if enabled.get(name):
            n = step.fn(out, api, ctx)
            if n:
                fired[name] = n
    return out, fired


def parse_step_switches(specs: list[str] | None) -> dict[str, bool]:
    """`["drop_metadata=off", "unify_model_suffix=on"]` -> {name: bool}; errors name the step."""
    out: dict[str, bool] = {}
    for spec in specs or []:
        name, _, val = spec.partition("=")
        if name not in STEPS or val not in ("on", "off"):
            raise ValueError(f"--step {spec!r}: expected NAME=on|off with NAME in {list(STEPS)}")
        out[name] = val == "on"
    return out
