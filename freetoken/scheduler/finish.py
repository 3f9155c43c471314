"""After a step's forward: each row's sampled token, the stop and length rules, the requests
that end.

`postprocess` is the scheduler's half of an engine step's last phase: it advances every item
(`Scheduler.after_forward`), appends each sampled token, decides whether the request ends
("stop": a stop token; "length": max_tokens or the context's end) and finishes those that do
(KV committed, final state donated). The engine emits the events and counts the statistics; it
holds no stop rule.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from freetoken.log import get_logger, kv
from freetoken.scheduler.plan import BatchItem
from freetoken.scheduler.request import Request
from freetoken.scheduler.scheduler import Scheduler
from freetoken.types.api import EngineEvent

log = get_logger("sched")


@dataclass(frozen=True)
class Sampled:
    """One row's outcome: its token (or why it could not be sampled: the request fails
    alone), the finish reason (None: it goes on), whether it was the request's first."""

    req: Request
    token: int | BaseException
    reason: str | None = None
    first: bool = False


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


def postprocess(sched: Scheduler, items: list[BatchItem], tokens: list, max_context: int,
                ran_ahead: Callable[[Request], bool]) -> list[Sampled]:
    """Advance `items` (one forward) and take `tokens`, one per item that wants logits, in
    item order (an exception: that row could not be sampled). A request that ends is finished
    here; `ran_ahead(r)` says whether the step in flight has a row of it (the engine has read
    that step): that row fed the stop token and advanced r's KV and state past it, so the
    token counts as computed and the prefix committed is the one the state covers."""
    out: list[Sampled] = []
    row = 0
    for it in items:
        sched.after_forward(it)
        if not it.wants_logits:
            continue
        r, tok = it.req, tokens[row]
        row += 1
        if isinstance(tok, BaseException):
            out.append(Sampled(r, tok))
            continue
        reason, first = accept_token(r, tok, max_context)
        if reason:
            if ran_ahead(r):
                r.computed += 1
            sched.finish(r)
            r.finished = True
            log.info(kv("finish", rid=r.rid, prompt=r.prompt_len, cached=r.cached_tokens,
                        kv_match=r.kv_match, resume_tier=r.state_tier,
                        reuse=r.reuse_reason if r.kv_match > r.cached_tokens else None,
                        lost=r.lost or None, generated=r.num_generated, reason=reason))
        out.append(Sampled(r, tok, reason, first))
    return out


def token_event(r: Request, tok: int, reason: str | None) -> EngineEvent:
    return EngineEvent([tok], finished=reason is not None, finish_reason=reason,
                       prompt_tokens=r.prompt_len, cached_tokens=r.cached_tokens,
                       matched_stop_id=tok if reason == "stop" else None)
