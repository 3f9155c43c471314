"""Per-session memory of the previous request, and the edit point of each new one.

With our engine the comparison is on token ids: the edit point is the first position where the
new prompt differs from the previous prompt of the session; it falls in the block of the last
anchor of the previous prompt at or before it. When that anchor was a predicted cut point the
prediction hit (the engine kept a `cut_point` snapshot exactly where reuse has to stop). A new
prompt that starts with the whole previous one is an `append` (no edit; the end-of-request
snapshot covers it). In front of another engine (no tokenizer) the comparison is on the
canonical JSON of the messages: the edit point is a message index.
"""
from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from freetoken.log import get_logger, kv
from freetoken.proxy import jsonc
from freetoken.types.api import Anchor

log = get_logger("proxy")


@dataclass(frozen=True)
class EditPoint:
    """`kind`: 'new' (first request of the session), 'append' (no edit) or 'edit'. `position`:
    first divergent token (unit 'token') or message (unit 'message'); `block`: the anchor kind
    (and role) or message role it falls in; `predicted_hit`: the block's anchor was a predicted
    cut point (None when nothing was predicted or not an edit)."""

    kind: str
    unit: str
    position: int | None = None
    block: str | None = None
    prev_len: int = 0
    predicted_hit: bool | None = None


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _label(a: Anchor) -> str:
    return f"{a.kind}({a.role})" if a.role else a.kind


@dataclass
class _Prev:
    items: list[Any]
    anchors: list[Anchor] = field(default_factory=list)
    predicted: frozenset[int] = frozenset()
    roles: list[str] = field(default_factory=list)
    seen: float = 0.0  # last use (time.monotonic), set by SessionStore


class SessionStore:
    """LRU of sessions (at most `max_sessions`; one idle for `idle_s` goes too, as the proxy's
    session metrics do: a 200k-token session holds 1.6 MB), thread-safe."""

    def __init__(self, max_sessions: int = 512, idle_s: float = 6 * 3600.0) -> None:
        self._prev: OrderedDict[str, _Prev] = OrderedDict()
        self._lock = threading.Lock()
        self.max_sessions, self.idle_s = max_sessions, idle_s
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._prev)

    def _swap(self, key: str, new: _Prev) -> _Prev | None:
        new.seen = now = time.monotonic()
        with self._lock:
            old = self._prev.pop(key, None)
            self._prev[key] = new
            while self._prev:  # the front is the least recently used
                first = next(iter(self._prev.values()))
                if len(self._prev) <= self.max_sessions and first.seen >= now - self.idle_s:
                    break
                self._prev.popitem(last=False)
                self.evicted += 1
        return old

    def observe_tokens(self, key: str, ids: Sequence[int], anchors: Sequence[Anchor],
                       predicted: Sequence[int]) -> EditPoint:
        # 8 bytes a token (a list of ints is ~36): a 200k-token prompt per session is 1.6 MB
        old = self._swap(key, _Prev(array("q", ids), list(anchors), frozenset(predicted)))
        if old is None:
            return EditPoint("new", "token")
        d = first_divergence(old.items, ids)
        if d >= len(old.items):
            return EditPoint("append", "token", d, None, len(old.items))
        at = [a for a in old.anchors if a.position <= d]
        block = at[-1] if at else None
        hit = (block.position in old.predicted) if (block and old.predicted) else (
            False if old.predicted else None)
        ep = EditPoint("edit", "token", d, _label(block) if block else "start", len(old.items),
                       hit)
        log.info(kv("edit_point", session=key, pos=d, block=ep.block, prev=len(old.items),
                    new=len(ids), predicted_hit=hit))
        return ep

    def observe_messages(self, key: str, messages: Sequence[Any]) -> EditPoint:
        items = [jsonc.canonical(m) for m in messages]
        roles = [str(m.get("role")) if isinstance(m, dict) else "?" for m in messages]
        old = self._swap(key, _Prev(items, roles=roles))
        if old is None:
            return EditPoint("new", "message")
        d = first_divergence(old.items, items)
        if d >= len(old.items):
            return EditPoint("append", "message", d, None, len(old.items))
        ep = EditPoint("edit", "message", d, old.roles[d], len(old.items))
        log.info(kv("edit_point", session=key, message=d, role=ep.block, prev=len(old.items),
                    new=len(items)))
        return ep
