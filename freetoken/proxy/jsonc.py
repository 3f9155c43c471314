"""The proxy's JSON codec: the standard library reads, orjson (a base dependency) writes.

Reading stays with `json`: orjson parses this traffic (long strings) only ~1.5x faster and
silently turns integers past 64 bits into floats, which would change a tool input the model
wrote. NaN and Infinity are refused on the way in (they are not JSON; forwarded as they were,
one upstream reads them as null, another refuses the request), so the proxy answers 400 itself.
Writing goes through orjson where installed (an order of magnitude faster than `json.dumps` on a
78 kB body: compact UTF-8, which any JSON reader reads as the same value) and falls back to
`json.dumps` for what orjson refuses (integers past 64 bits, lone surrogates, non-string keys)
or when it is missing.
"""
from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - exercised by tests that hide orjson
    orjson = None  # type: ignore[assignment]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(raw: bytes | str) -> Any:
    """`json.loads` without NaN/Infinity (ValueError, like any other invalid JSON)."""
    return json.loads(raw, parse_constant=_no_constant)


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
