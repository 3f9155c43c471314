"""Per-request records (one JSONL line each) and their aggregate for `GET /proxy/stats`.

State is bounded: per-harness buckets (a handful of adapters), the last `keep` records, and
per-session buckets in an LRU of at most `max_sessions`, where a session without a request for
`session_idle_s` is dropped (counted in `sessions_evicted`). `/proxy/stats` lists the most
recently active sessions a page at a time (`?sessions=N&offset=K`, default 50 from 0) with the
total, never all of them.

A record holds what is needed to see the reuse a harness's edits allow: session, harness, the
edit point against the session's previous request, prompt / cached / recomputed tokens, TTFT,
decode tok/s, predicted vs actual cut, the normalisation steps that fired and the output cap.
No header and no key is ever part of a record.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from freetoken.log import get_logger

log = get_logger("proxy")


@dataclass
class RequestRecord:
    request_id: str
    harness: str
    session: str
    api_in: str
    api_out: str
    path: str
    stream: bool
    t_start: float = field(default_factory=time.time)
    status: int = 200
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    ttft_ms: float | None = None
    decode_tok_s: float | None = None
    duration_ms: float | None = None
    edit_kind: str | None = None
    edit_unit: str | None = None
    edit_position: int | None = None
    edit_block: str | None = None
    predicted_cuts: list[int] = field(default_factory=list)
    predicted_hit: bool | None = None
    normalised: dict[str, int] = field(default_factory=dict)
    max_tokens_requested: int | None = None
    max_tokens_sent: int | None = None
    capped: bool = False
    finish: str | None = None
    disconnected: bool = False
    error: str | None = None

    @property
    def recomputed_tokens(self) -> int | None:
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens - (self.cached_tokens or 0)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if not k.startswith("_")}  # asdict is slow
        d["recomputed_tokens"] = self.recomputed_tokens
        return d


def _bucket() -> dict[str, Any]:
    return {"requests": 0, "errors": 0, "prompt_tokens": 0, "cached_tokens": 0,
            "cached_unknown": 0, "_known_prompt": 0,
            "recomputed_tokens": 0, "output_tokens": 0, "edits": 0, "appends": 0,
            "predicted_hits": 0, "predicted_misses": 0, "ttft_ms_sum": 0.0, "ttft_n": 0,
            "normalised": {}}


class Metrics:
    """Collects finished records; appends each to `jsonl_path` when given."""

    def __init__(self, jsonl_path: str | Path | None = None, keep: int = 1000,
                 max_sessions: int = 4096, session_idle_s: float = 6 * 3600.0) -> None:
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if jsonl_path:
            Path(jsonl_path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 - lives with us
        self.by_harness: dict[str, dict[str, Any]] = {}
        self.by_session: OrderedDict[str, dict[str, Any]] = OrderedDict()  # oldest use first
        self.recent: list[dict[str, Any]] = []
        self.keep = keep
        self.max_sessions, self.session_idle_s = max_sessions, session_idle_s
        self.sessions_evicted = 0

    def _expire(self, now: float) -> None:
        """Drop sessions past the cap or idle too long (the LRU's front is the oldest)."""
        s = self.by_session
        while s and (len(s) > self.max_sessions
                     or next(iter(s.values()))["last_seen"] < now - self.session_idle_s):
            s.popitem(last=False)
            self.sessions_evicted += 1

    def record(self, rec: RequestRecord) -> None:
        if getattr(rec, "_recorded", False):  # the engine path and the error path both finish
            return
        rec._recorded = True  # type: ignore[attr-defined]
        line = rec.to_json()
        with self._lock:
            for table, key in ((self.by_harness, rec.harness), (self.by_session, rec.session)):
                b = table.setdefault(key, _bucket())
                b["requests"] += 1
                b["errors"] += int(rec.status >= 400 or rec.error is not None)
                b["prompt_tokens"] += rec.prompt_tokens or 0
                b["cached_tokens"] += rec.cached_tokens or 0
                if rec.prompt_tokens and rec.cached_tokens is None:
                    b["cached_unknown"] += 1  # the upstream reports no cache counter
                else:
                    b["_known_prompt"] += rec.prompt_tokens or 0
                b["recomputed_tokens"] += rec.recomputed_tokens or 0
                b["output_tokens"] += rec.output_tokens
                b["edits"] += int(rec.edit_kind == "edit")
                b["appends"] += int(rec.edit_kind == "append")
                b["predicted_hits"] += int(rec.predicted_hit is True)
                b["predicted_misses"] += int(rec.predicted_hit is False)
                if rec.ttft_ms is not None:
                    b["ttft_ms_sum"] += rec.ttft_ms
                    b["ttft_n"] += 1
                for step, n in rec.normalised.items():
                    b["normalised"][step] = b["normalised"].get(step, 0) + n
                if table is self.by_session:
                    b["harness"] = rec.harness
                    b["last_seen"] = time.time()
                    self.by_session.move_to_end(key)
            self._expire(time.time())
            self.recent.append(line)
            del self.recent[:-self.keep]
            if self._file is not None:
                self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
                self._file.flush()

    def stats(self, sessions: int = 50, offset: int = 0) -> dict[str, Any]:
        """Aggregates; `sessions` of the per-session buckets from `offset`, most recently
        active first."""
        def view(b: dict[str, Any]) -> dict[str, Any]:
            out = {k: v for k, v in b.items() if k not in ("ttft_ms_sum", "ttft_n",
                                                              "last_seen", "_known_prompt")}
            # over the requests whose reuse is known; None when no request's is
            out["cached_ratio"] = (round(b["cached_tokens"] / b["_known_prompt"], 4)
                                   if b["_known_prompt"] else None)
            out["ttft_ms_mean"] = round(b["ttft_ms_sum"] / b["ttft_n"], 2) if b["ttft_n"] else None
            judged = b["predicted_hits"] + b["predicted_misses"]
            out["predicted_hit_rate"] = round(b["predicted_hits"] / judged, 4) if judged else None
            return out

        with self._lock:
            self._expire(time.time())
            page: dict[str, Any] = {}
            for i, k in enumerate(reversed(self.by_session)):
                if i >= offset + sessions:
                    break
                if i >= offset:
                    page[k] = view(self.by_session[k])
            return {"harnesses": {k: view(v) for k, v in self.by_harness.items()},
                    "sessions": page, "sessions_total": len(self.by_session),
                    "sessions_offset": offset, "sessions_evicted": self.sessions_evicted,
                    "requests": sum(v["requests"] for v in self.by_harness.values())}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
