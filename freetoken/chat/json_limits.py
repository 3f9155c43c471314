"""The limits every JSON text from a client is held to, whether it is a request body
(`freetoken.server.validation.parse_json`) or a string inside one (a tool call's `arguments`,
`freetoken.chat.mapping.parse_arguments`): nested at most MAX_DEPTH deep, integers of at most
MAX_INT_DIGITS digits, no lone UTF-16 surrogate escape (`"\\ud800"`: such a string cannot be
tokenized nor encoded back into a response). Python's own parser would raise RecursionError or
ValueError on the first two, which are not `JSONDecodeError`s and used to escape as 500s.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
MAX_INT_DIGITS = 4300  # Python's own int-conversion limit, said here so the error is ours
# A `\uD800`-`\uDFFF` escape: the only way a lone surrogate gets into a decoded JSON string
# (strict UTF-8 decoding refuses raw surrogates). Pairs match too; the full check sorts them out.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
SURROGATE_ESCAPE_B = re.compile(rb"\\u[dD][89a-fA-F]")


class JSONLimitError(ValueError):
    """A JSON text that breaks a limit (or is no JSON); the message says which."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONLimitError(f"an integer has more than {MAX_INT_DIGITS} digits")
    return int(text)


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests deeper than `limit` (iterative: no recursion limit to hit)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return False


def has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def loads(text: str) -> Any:
    """`json.loads` under the limits above; JSONLimitError (a ValueError) otherwise."""
    try:
        value = json.loads(text, parse_int=_int)
    except JSONLimitError:
        raise
    except json.JSONDecodeError as e:
        raise JSONLimitError(f"not valid JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        raise JSONLimitError(f"not valid JSON: {e}"[:200]) from None
    if too_deep(value):
        raise JSONLimitError(f"nested deeper than {MAX_DEPTH} levels")
    if SURROGATE_ESCAPE.search(text) and has_lone_surrogate(value):
        raise JSONLimitError("contains a lone UTF-16 surrogate escape (e.g. '\\ud800' without "
                             "its pair); strings must be valid Unicode")
    return value
