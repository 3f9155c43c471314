"""Prompt compaction: the trained demo model's cut of a harness request, the same at train and
at serve time (issue 27).

A 0.9M-active-parameter model cannot find a four-word task inside Claude Code's 19.5k-token
prompt in our training budget; cut to the task line it learns to copy it (docs/models.md, "Does
the data teach copying?"). So the demo model is trained on compacted prompts and served the same
cut: `compact(messages, tools)` maps a template input (the messages and OpenAI-style tools that
`anthropic_to_template` / `openai_to_template` produce) to a shorter one that keeps what a task
needs:

- tools: each tool's name and its parameter schema, without descriptions, titles or examples
  (a parameter *named* `description`, Claude Code's Bash has one, stays);
- system messages: a short one (<= `SHORT_SYSTEM` characters, mini-swe-agent's protocol) is
  kept whole; a long one is dropped, and its environment lines (working directory, platform)
  open the first user message after it, so the working directory sits beside the task, right
  before the answer, instead of ~2k tokens of tool schemas earlier;
- user messages: `<system-reminder>` and OpenClaw internal-context blocks dropped, a Codex
  `<environment_context>` block becomes its working-directory line; what is left, if longer than
  `LONG_USER` characters (mini-swe-agent's task + instructions), is cut to its first paragraph
  (at most `HEAD_CHARS`); an empty one is dropped;
- tool results (role `tool`): `<system-reminder>` blocks dropped, then the first
  `RESULT_LINES` lines and `RESULT_CHARS` characters, then a `[truncated]` line;
- assistant messages: as they are (what the model wrote, calls and all).

`demo-v2` (data v6) is `demo-v1` with the tool list cut to the core tools (`CORE_TOOLS`): the
ones the demo's tasks call in some harness (Claude Code Bash/Write, OpenCode bash/read/write,
OpenClaw ls/read/exec/write, Codex exec_command, mini-swe-agent bash), each slimmed as in
demo-v1, in the request's order; a request whose tools hold none of them keeps them all (slimmed).
Claude Code's first request in Qwen3 tokens (chat template; as sent -> demo-v1 -> demo-v2):
recorded (tests/data/harness_traces/claude_code/cc_try1.jsonl, seq 1) 18,868 -> 2,382 -> 298;
as data v6 starts it (`demo_data.base_request`, "list the files" in /tmp/tmpa8x_k2q1) 18,838 ->
2,352 (24 tool schemas) -> 268 (Bash, Write; 402 with Read, which v6's reads no longer call).
OpenClaw 11,675 -> 1,365 -> 617, OpenCode 6,883 -> 835 -> 399, Codex 6,245 -> 743 -> 275;
mini-swe-agent's (one tool or none) unchanged.

Contract (every version): deterministic and causal — the compaction of a message depends on
that message and the ones before it only (and the tools on the tools), so the same earlier
messages always compact to the same messages and the rendered prefix, hence the radix cache's
reuse, is kept turn to turn.
The inputs are not modified.

Which compaction a model gets is declared by the checkpoint: `demo_manifest.json`'s
`prompt_compaction` names a version of `COMPACTIONS` (`compaction_for_dir`); a checkpoint that
names none (demo-random, every real checkpoint, the v4 demo) is rendered as sent.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None
Compaction = Callable[[Messages, Tools], tuple[Messages, Tools]]

VERSION = "demo-v1"
VERSION_V2 = "demo-v2"
# the tools the demo's training tasks call (freetoken/models/demo_harnesses.py), every harness
CORE_TOOLS = frozenset({"Bash", "Write", "bash", "read", "write", "ls", "exec",
                        "exec_command"})
SHORT_SYSTEM = 600
LONG_USER = 1200
HEAD_CHARS = 600
RESULT_LINES = 40
RESULT_CHARS = 2000
TRUNCATED = "[truncated]"

_ENV_LINE = re.compile(r"^\s*(?:[-*]\s*)?(primary working directory|working directory|platform)"
                       r"\s*:\s*(\S.*?)\s*$", re.IGNORECASE | re.MULTILINE)
_DROP_BLOCKS = (re.compile(r"<system-reminder>.*?</system-reminder>", re.DOTALL),
                re.compile(r"<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>.*?"
                           r"<<<END_OPENCLAW_INTERNAL_CONTEXT>>>", re.DOTALL))
_ENV_CONTEXT = re.compile(r"<environment_context>.*?</environment_context>", re.DOTALL)
_CWD_TAG = re.compile(r"<cwd>(.*?)</cwd>", re.DOTALL)
_SCHEMA_NOTES = ("description", "title", "examples", "$schema", "$comment")


def env_lines(text: str) -> list[str]:
    """The environment lines of a system text, normalized ("Working directory: X",
    "Platform: Y"), the first of each kind, in that order."""
    found: dict[str, str] = {}
    for m in _ENV_LINE.finditer(text):
        key = "Platform" if m.group(1).lower() == "platform" else "Working directory"
        found.setdefault(key, m.group(2))
    return [f"{k}: {found[k]}" for k in ("Working directory", "Platform") if k in found]


def slim_schema(schema: Any) -> Any:
    """A JSON schema without its notes (`_SCHEMA_NOTES` keywords), keywords that constrain kept;
    `properties` maps names (any name, `description` included) to slimmed schemas."""
    if isinstance(schema, list):
        return [slim_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_NOTES:
            continue
        if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: slim_schema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "not", "anyOf", "oneOf", "allOf",
                   "prefixItems", "if", "then", "else", "contains"):
            out[k] = slim_schema(v)
        else:
            out[k] = v
    return out


def compact_tools(tools: Tools) -> Tools:
    if not tools:
        return tools
    out = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else t
        if not isinstance(fn, dict) or "name" not in fn:
            out.append(t)
            continue
        slim = {"name": fn["name"]}
        if "parameters" in fn:
            slim["parameters"] = slim_schema(fn["parameters"])
        out.append({"type": "function", "function": slim} if "function" in t else slim)
    return out


def _drop_blocks(text: str) -> str:
    for block in _DROP_BLOCKS:
        text = block.sub("", text)
    return text


def _user(text: str) -> str:
    text = _drop_blocks(text)
    text = _ENV_CONTEXT.sub(lambda m: "\n".join(
        f"Working directory: {c.strip()}" for c in _CWD_TAG.findall(m.group(0))[:1]), text)
    text = text.strip()
    if len(text) > LONG_USER:
        text = text.split("\n\n", 1)[0][:HEAD_CHARS].rstrip()
    return text


def truncate_result(text: str) -> str:
    lines = text.split("\n")
    cut = "\n".join(lines[:RESULT_LINES])
    if len(cut) > RESULT_CHARS:
        cut = cut[:RESULT_CHARS]
    return text if cut == text else cut + "\n" + TRUNCATED


def compact_message(m: dict[str, Any]) -> dict[str, Any] | None:
    """One message compacted (None: dropped). Only string contents are cut."""
    content, role = m.get("content"), m.get("role")
    if not isinstance(content, str) or role == "assistant":
        return m
    if role == "system":
        new = content if len(content) <= SHORT_SYSTEM else ""  # (`compact` takes the env)
    elif role == "user":
        new = _user(content)
    elif role == "tool":
        return {**m, "content": truncate_result(_drop_blocks(content))}
    else:
        return m
    return {**m, "content": new} if new else None


def compact(messages: Messages, tools: Tools) -> tuple[Messages, Tools]:
    """The compacted (messages, tools): see the module docstring. A request that would lose
    every message keeps its last one as sent."""
    out: Messages = []
    env: list[str] = []  # a long system prompt's environment lines, until a user message
    placed = False
    for m in messages:
        long_system = (m.get("role") == "system" and isinstance(m.get("content"), str)
                       and len(m["content"]) > SHORT_SYSTEM)
        if long_system:
            env = env or env_lines(m["content"])
            continue
        c = compact_message(m)
        if c is None:
            continue
        if env and not placed and c["role"] == "user" and isinstance(c["content"], str):
            c = {**c, "content": "\n".join(env) + "\n\n" + c["content"]}
            placed = True
        out.append(c)
    return (out or list(messages[-1:])), compact_tools(tools)


def tool_name(t: Any) -> str | None:
    fn = t.get("function", t) if isinstance(t, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None


def core_tools(tools: Tools) -> Tools:
    """The tools named in `CORE_TOOLS`, in order; all of them when none is."""
    if not tools:
        return tools
    core = [t for t in tools if tool_name(t) in CORE_TOOLS]
    return core or tools


def compact_v2(messages: Messages, tools: Tools) -> tuple[Messages, Tools]:
    """`demo-v2`: `compact`'s messages, the core tools slimmed (the module docstring)."""
    out, _ = compact(messages, None)
    return out, compact_tools(core_tools(tools))


COMPACTIONS: dict[str, Compaction] = {VERSION: compact, VERSION_V2: compact_v2}


def compaction_for_dir(model_dir: str | Path) -> tuple[str, Compaction] | None:
    """(version, function) that `model_dir/demo_manifest.json` declares as `prompt_compaction`;
    None when the directory has no such manifest or it names none. A version this code does not
    know is an error: serving a model its training cut is missing from would be silently wrong."""
    path = Path(model_dir) / "demo_manifest.json"
    if not path.is_file():
        return None
    name = json.loads(path.read_text()).get("prompt_compaction")
    if not name:
        return None
    if name not in COMPACTIONS:
        raise ValueError(f"{path}: prompt_compaction {name!r} is not one of {sorted(COMPACTIONS)}")
    return name, COMPACTIONS[name]
