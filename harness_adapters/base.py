"""The harness adapter contract.

A harness (Claude Code, OpenCode, OpenClaw, SWE-agent, ...) is recognised from what it sends and
then told apart from every other harness by four answers, which are the whole contract:

- `detect(req) -> bool`: this adapter owns the request. Pure; looks at headers and body only.
  Adapters are tried in registry order and `generic` (always True) comes last.
- `normalise(req, steps) -> (body, fired)`: the body with what needlessly breaks prefix reuse
  removed, through the named pipeline steps of `harness_adapters.normalise`. The adapter
  picks which steps apply to it; the caller's `steps` switches override the defaults. `fired`
  names each step that changed something, with a count. Never mutates `req.body` unless told
  (`copy=False`, for a caller that owns a private parse of the body).
- `session_key(req) -> str`: the same string for every request of one conversation and a
  different one for siblings (sub-agents, title requests): the harness's session header where
  it sends one, qualified by a hash of the conversation's root (so sub-agents sharing a header
  still get their own key), else a hash of the stable head (system + tools + first user
  message). Never the API key.
- `cut_points(anchors, messages) -> list[int]`: the anchor positions of *this* request where
  the adapter expects the *next* request of the session to diverge (the engine snapshots
  recurrent state there and keeps it longer: class `cut_point`). `anchors` are the rendered
  prompt's anchors (`freetoken.chat.detect_anchors`), `messages` the normalised conversation
  as template messages (OpenAI shape: role, content, tool_calls, tool messages), in the order
  the template renders them. Positions returned are a subset of the anchors' positions.

Two more answers, with defaults. `parent_key(req) -> str | None`: the session key (or its
`name:id:` prefix) of the session that spawned this one, for sub-agents (the engine values a
parent's latest snapshot while its sub-agents run, and a finished sub-agent's lowest).
`head_breaks(body) -> list[int]`, character offsets into the
leading system text (`system_text(body)`, as the template renders it) where *another session*
of this harness may part from this one although the text before is the same: each Anthropic
system block after the first, and the start of each of the adapter's `head_marks` (the section
holding the working directory, the date). The proxy marks them as `system_block` anchors, which
the engine snapshots with class `head`: a new session in another directory, or on another day,
resumes there instead of recomputing the whole system prompt. `user_breaks(body) -> list[int]`,
the same for the first user message's text (`first_user_text(body)`): where a request that
keeps that message's opening part (Claude Code's `<system-reminder>` context block: sibling
sub-agents, the request after a compaction) parts from this one; marked the same way.

An adapter is stateless; one instance serves every request.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from freetoken.types.api import Anchor
from harness_adapters.normalise import digest

BILLING = "x-anthropic-billing-header"  # Claude Code's per-session system block


@dataclass(frozen=True)
class HarnessRequest:
    """One incoming request: `api` is 'anthropic' or 'openai' (the surface it came in on),
    `headers` lower-cased, `body` the parsed JSON as received."""

    api: str
    path: str
    headers: Mapping[str, str]
    body: dict[str, Any]

    @property
    def user_agent(self) -> str:
        return str(self.headers.get("user-agent", ""))


def text_of(content: Any) -> str:
    """The text of an OpenAI/Anthropic content value (string or text parts/blocks)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content
                         if isinstance(b, dict) and b.get("type") == "text")
    return ""


def system_text(body: dict[str, Any]) -> str:
    """The leading system text of either API shape, without Claude Code's billing block."""
    if "system" in body:
        sys = body["system"]
        if isinstance(sys, list):
            return "\n".join(text_of([b]) for b in sys if isinstance(b, dict) and not
                             str(b.get("text", "")).startswith(BILLING))
        return text_of(sys)
    msgs = body.get("messages") or []
    if msgs and isinstance(msgs[0], dict) and msgs[0].get("role") in ("system", "developer"):
        return text_of(msgs[0].get("content"))
    return ""


def first_user_text(body: dict[str, Any]) -> str:
    for m in body.get("messages") or []:
        if isinstance(m, dict) and m.get("role") == "user":
            return text_of(m.get("content"))
    return ""


def tool_names(body: dict[str, Any]) -> list[str]:
    out = []
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            fn = t.get("function") if isinstance(t.get("function"), dict) else t
            out.append(str(fn.get("name", "")))
    return out


def head_hash(body: dict[str, Any]) -> str:
    """The stable head of a conversation: system text, tool names, first user message."""
    return digest(system_text(body), tool_names(body), first_user_text(body))


def anchors_of(anchors: Sequence[Anchor], kind: str, role: str | None = None) -> list[Anchor]:
    return [a for a in anchors if a.kind == kind and (role is None or a.role == role)]


class HarnessAdapter:
    """Base adapter: no detection, default normalisation, header-or-head session key, and
    `head_end` as the only predicted cut (compaction and sub-agents keep system + tools).
    Subclasses override what their harness does differently; see the module docstring.
    """

    name = "base"
    #: pipeline steps on by default for this harness (harness_adapters.normalise.STEPS names)
    default_steps: tuple[str, ...] = ("strip_billing_header", "drop_cache_control",
                                      "drop_metadata", "canonical_content", "stable_tool_ids",
                                      "system_in_place")
    #: header carrying the harness's own session id, if it sends one
    session_headers: tuple[str, ...] = ()
    #: header naming the parent session of a sub-agent, if the harness sends one
    parent_headers: tuple[str, ...] = ()
    #: text opening a part of the system prompt that differs between sessions (see head_breaks)
    head_marks: tuple[str, ...] = ()
    #: lines whose end is a head break: the lines after them are a list the harness filters
    #: per run (a tool dropped from it parts the prompt from the others right there)
    head_line_ends: tuple[str, ...] = ()
    #: tools the harness's sub-agents are not offered: their prompts part from the parent's at
    #: the first of them in the tools block (a `tool_def` anchor, predicted as a cut)
    sub_agent_drops: tuple[str, ...] = ()

    def detect(self, req: HarnessRequest) -> bool:
        return False

    def normalise(self, req: HarnessRequest, steps: Mapping[str, bool] | None = None,
                  fold_system: bool = False, copy: bool = True
                  ) -> tuple[dict[str, Any], dict[str, int]]:
        from harness_adapters.normalise import run_pipeline

        enabled = {s: True for s in self.default_steps}
        enabled.update(steps or {})
        return run_pipeline(req.body, req.api, enabled, fold_system=fold_system, copy=copy)

    def session_key(self, req: HarnessRequest) -> str:
        for h in self.session_headers:
            v = req.headers.get(h)
            if v:
                return f"{self.name}:{str(v)[:128]}:{head_hash(req.body)}"
        return f"{self.name}:{head_hash(req.body)}"

    def parent_key(self, req: HarnessRequest) -> str | None:
        """The session key of the session that spawned this one (a sub-agent's parent), or a
        prefix of it ending in ':' (`name:harness-session-id:`, which the engine resolves to
        the latest top-level session with that id, `freetoken.cache.lineage`); None for a
        top-level session or where the harness does not say. Default: the harness's parent
        header (Codex and `generic` read Codex's turn metadata instead)."""
        for h in self.parent_headers:
            v = req.headers.get(h)
            if v:
                return f"{self.name}:{str(v)[:128]}:"
        return None

    def head_breaks(self, body: dict[str, Any]) -> list[int]:
        """Sorted offsets into `system_text(body)` (see the module docstring): where the text
        before each system block after the first, before the line each head mark is on, and
        up to the end of the line each `head_line_ends` mark is on, ends (trailing whitespace
        excluded: it may merge with what follows into one token)."""
        text = system_text(body)
        starts: list[int] = []
        sys = body.get("system")
        if isinstance(sys, list):
            at = 0  # system_text joins the kept blocks with "\n"
            for b in sys:
                if isinstance(b, dict) and not str(b.get("text", "")).startswith(BILLING):
                    starts.append(at)
                    at += len(text_of([b])) + 1
            starts = starts[1:]
        for mark in self.head_marks:
            i = text.find(mark)
            if i > 0:
                starts.append(text.rfind("\n", 0, i) + 1)
        for mark in self.head_line_ends:
            i = text.find(mark)
            j = text.find("\n", i + len(mark)) if i >= 0 else -1
            if j > 0:
                starts.append(j)
        return sorted({len(text[:i].rstrip()) for i in starts} - {0})

    def user_breaks(self, body: dict[str, Any]) -> list[int]:
        """Sorted offsets into `first_user_text(body)` (see the module docstring); none by
        default."""
        return []

    def cut_points(self, anchors: Sequence[Anchor], messages: Sequence[dict[str, Any]]
                   ) -> list[int]:
        """`head_end`, the `tool_def` anchor of the first tool in `sub_agent_drops` (where a
        sub-agent's prompt parts from its parent's), and the `<think>` of the generation prompt
        when the template pre-opens a think block there (an empty one when thinking is off):
        the next request renders the reply in place of that block, and templates that drop
        or reshape reasoning re-render it differently, so that is where the prompt diverges."""
        out = [a.position for a in anchors_of(anchors, "head_end")]
        drops = [a.position for a in anchors_of(anchors, "tool_def")
                 if a.role in self.sub_agent_drops]
        out += drops[:1]
        last_turn = next((i for i in range(len(anchors) - 1, -1, -1)
                          if anchors[i].kind == "turn_start"), None)
        if last_turn is not None and anchors[last_turn].role == "assistant":
            out += [a.position for a in anchors[last_turn + 1:] if a.kind == "think_start"]
        return out
