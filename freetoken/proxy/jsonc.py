"""The proxy's JSON codec: orjson where it is installed (a base dependency; parses and encodes a
78 kB Claude Code body several times faster than the standard library), the standard library
otherwise and for what orjson refuses.

Same values either way: whatever orjson rejects on input (NaN/Infinity, integers past 64 bits,
lone surrogate escapes, UTF-16/32 bodies) is parsed by `json` exactly as before; on output
orjson writes compact UTF-8 (no spaces, non-ASCII unescaped), which any JSON reader reads as
the same value. One difference is left: a NaN/Infinity that came in (not JSON) goes out as null.
"""
from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - exercised by tests that hide orjson
    orjson = None  # type: ignore[assignment]


def loads(raw: bytes | str) -> Any:
    """`json.loads`, faster. Raises what `json.loads` raises for what neither accepts."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the standard library accepts a little more; it decides
    return json.loads(raw)


def dumps(obj: Any) -> bytes:
    """UTF-8 JSON bytes (compact from orjson; what `json.dumps` wrote before otherwise)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:  # ints past 64 bits, lone surrogates, non-str keys
            pass
    return json.dumps(obj).encode()


def canonical(obj: Any) -> bytes:
    """A key-order-independent encoding, for comparing values (never sent anywhere)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            pass
    return json.dumps(obj, sort_keys=True).encode()
