"""Helpers shared by the workload generators: scaling real shapes down, ids, reasoning text."""
from __future__ import annotations

import copy
import json
import random
from typing import Any

from workloads.content import prose, sized
from workloads.tokens import truncate_to_tokens


def shrink_text(text: str, tokens: int) -> str:
    """The first `tokens` tokens of a real prompt text (tiny scale keeps the real opening)."""
    return truncate_to_tokens(text, tokens, at_line=False)


def _shrink_schema(x: Any, tokens: int) -> Any:
    if isinstance(x, dict):
        return {k: (shrink_text(v, tokens) if k == "description" and isinstance(v, str)
                    else _shrink_schema(v, tokens)) for k, v in x.items()}
    if isinstance(x, list):
        return [_shrink_schema(v, tokens) for v in x]
    return x


def shrink_tools(tools: list[dict[str, Any]], keep: tuple[str, ...],
                 desc_tokens: int) -> list[dict[str, Any]]:
    """The tools named in `keep` (in their recorded order), every description cut to
    `desc_tokens` tokens; works on both the Anthropic and the OpenAI tool shape."""
    def name(t: dict[str, Any]) -> str:
        return str(t["function"]["name"] if "function" in t else t["name"])
    return [_shrink_schema(copy.deepcopy(t), desc_tokens) for t in tools if name(t) in keep]


def hex_id(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def b62_id(rng: random.Random, n: int) -> str:
    abc = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    return "".join(rng.choice(abc) for _ in range(n))


def thinking(rng: random.Random, tokens: int) -> str:
    """Reasoning text of about `tokens` tokens (a recorded reply's thinking part)."""
    return sized(prose(rng), max(1, tokens), at_line=False)


def compact(args: dict[str, Any]) -> str:
    """Tool-call arguments as the harnesses re-serialise them into history (no spaces), where
    the server streamed them with spaces."""
    return json.dumps(args, separators=(",", ":"), ensure_ascii=False)


def numbered(text: str, style: str) -> str:
    """A file read as the harness's read tool returns it: `cc` is Claude Code's `N\\tline`,
    `oc` OpenCode's `<content>` block with `N: line`."""
    lines = text.split("\n")
    if style == "cc":
        return "\n".join(f"{i}\t{line}" for i, line in enumerate(lines, 1))
    body = "\n".join(f"{i}: {line}" for i, line in enumerate(lines, 1))
    return (f"<type>file</type>\n<content>\n{body}\n\n"
            f"(End of file - total {len(lines)} lines)\n</content>")
