"""A request as the scheduler sees it, and what it holds in the caches."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from freetoken.sampler import RequestSampler
from freetoken.types.api import EngineEvent, GenerateRequest


@dataclass
class Request:
    req: GenerateRequest
    sampler: RequestSampler
    emit: Callable[[EngineEvent], None]
    ids: list[int] = field(default_factory=list)  # prompt + generated
    prompt_len: int = 0
    # cache holdings (valid while running)
    node: object | None = None  # locked radix node ending at tree_len
    tree_len: int = 0  # ids[:tree_len] are tree-owned
    row: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # KV slots
    computed: int = 0  # ids[:computed] have their KV and state computed
    state_slot: int | None = None  # working recurrent state, covers ids[:computed]
    snap_points: list[tuple[int, str]] = field(default_factory=list)  # pending (pos, class)
    cached_tokens: int = 0
    reuse_reason: str = ""
    kv_match: int = 0  # raw KV match of the prompt at first admission
    state_tier: str | None = None  # tier of the snapshot the prompt resumed from
    lost: str = ""  # a deeper snapshot within the KV match that went away (why:tier@pos)
    logits_from: int | None = None  # kept logits row of the whole prompt (cache/logits.py)
    waiting_for: str | None = None  # a sibling whose shared prefill this request waits for
    in_lineage: bool = False  # counted by the cache's lineage (begin called, end pending)
    num_generated: int = 0
    finished: bool = False
    aborted: bool = False
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None

    @property
    def rid(self) -> str:
        return self.req.request_id

    @cached_property
    def prompt_array(self) -> np.ndarray:
        """The prompt as an array, for prefix comparisons repeated while a request waits."""
        return np.asarray(self.req.input_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to feed: 1 while decoding (the last sampled token), more in prefill
        (also after a preemption, when prompt + generated tokens are fed again)."""
        return len(self.ids) - self.computed

    def next_stop(self) -> int:
        """End of the next prefill chunk bound: the next snapshot point, else all but what
        is computed. A chunk never crosses a snapshot point."""
        for p, _ in self.snap_points:
            if p > self.computed:
                return p
        return len(self.ids)
