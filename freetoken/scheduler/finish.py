"""When a request ends: the stop and length rules applied to each sampled token."""
from __future__ import annotations

import time

from freetoken.scheduler.request import Request
from freetoken.types.api import EngineEvent


def accept_token(r: Request, tok: int, max_context: int) -> tuple[str | None, bool]:
    """Append `tok` to `r`; returns (its finish reason — "stop" for a stop token, "length" at
    max_tokens or the context's end, None to go on —, whether it was the first token)."""
    r.ids.append(tok)
    r.num_generated += 1
    first = r.t_first_token is None
    if first:
        r.t_first_token = time.perf_counter()
    if r.sampler.is_stop(tok, r.num_generated):
        return "stop", first
    if r.num_generated >= r.req.sampling.max_tokens or len(r.ids) >= max_context:
        return "length", first
    return None, first


def ends_by_length_next(r: Request, max_context: int) -> bool:
    """Whether the token being sampled now ends `r` by length (so no step comes after it)."""
    return (r.num_generated + 1 >= r.req.sampling.max_tokens
            or len(r.ids) + 1 >= max_context)


def token_event(r: Request, tok: int, reason: str | None) -> EngineEvent:
    return EngineEvent([tok], finished=reason is not None, finish_reason=reason,
                       prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens,
                       matched_stop_id=tok if reason == "stop" else None)
