"""What the scheduler hands the engine for one step: `StepPlan` and its `BatchItem` rows, and
the fair split of the prefill budget among the requests that prefill (`water_fill`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.cache import StateOp
from freetoken.scheduler.request import Request


@dataclass
class BatchItem:
    """One sequence's rows this step: `token_ids` at positions `[start, start + n)`, whose KV
    goes to `kv_slots[start:]` (`kv_slots[:start]` hold the cached prefix)."""

    req: Request
    n: int  # tokens fed this step
    wants_logits: bool
    start: int = 0
    token_ids: list[int] | None = None
    kv_slots: torch.Tensor | None = None  # [start + n]
    snapshot: tuple[int, str, int] | None = None  # (position, class, fresh state slot)
    keep_logits: int | None = None  # kept-logits slot the engine writes this item's last row to
    logits_from: int | None = None  # n == 0: the kept row its first token is sampled from


@dataclass
class StepPlan:
    """What the engine carries out this step, in order: `pre_ops`, the forward of `items`,
    `post_ops`, then `after_forward` per item."""

    items: list[BatchItem]
    pre_ops: list[StateOp]
    post_ops: list[StateOp]


def water_fill(needs: list[tuple[int, int]], budget: int) -> dict[int, int]:
    """Split `budget` tokens over `(need, key)` pairs, smallest need first: each gets its whole
    need or an equal share of what is left, at least 1. Returns key -> tokens given."""
    need = sorted(needs, key=lambda x: x[0])
    out, left = {}, budget
    for i, (want, key) in enumerate(need):
        give = min(want, max(left // (len(need) - i), 1))
        out[key] = give
        left = max(left - give, 0)
    return out
