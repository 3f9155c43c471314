"""The elastic-VRAM planner: how many expert slots, KV tokens and recurrent-state slots the
device should hold now.

Pure arithmetic over one `VramState` reading (no tensors, no clock), so every rule is tested
without a GPU. `plan` returns the new sizes, or None when nothing should change:

1. **memory claimed** (free < margin - hysteresis: another process took device memory): give
   the deficit back, from the expert cache first (down to `min_expert_slots`), then from the
   KV pool down to its floor (`kv_floor`: `--kv-reserve-tokens`, the context, and every token
   live requests hold), then from the state pool (models with linear attention) down to its floor
   (`state_floor`, and every working state and pinned snapshot: `state_live`);
2. **KV pressure** (live KV tokens past `kv_high` of the pool, pool below `kv_cap`): grow the
   pool to `kv_growth` x live, paid from free memory above the margin first, then from expert
   slots (agent contexts grow: budget moves from experts to KV above the reserve);
3. **memory returned** (free > margin + hysteresis): a state pool below its size
   (`state_cap`: `--state-slots`) grows back first, then the expert cache grows into the rest
   (up to `max_expert_slots`: the whole pool, or the budget the user set with
   `--moe-cache-size`, `--moe-cache-rate` or `--moe-cache-mem`, which rules 1 and 2 may go
   below but this rule never past); KV grows only on demand (rule 2).

The hysteresis band keeps a reading that wobbles around the margin from re-planning: after a
rebuild the free memory sits at the margin, inside the band.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from freetoken.types.config import WORKSPACE_MARGIN_BYTES

# defaults of the knobs (docs/server.md, `ft serve --vram-*`)
HYSTERESIS_BYTES = 512 * 2**20
KV_HIGH, KV_GROWTH = 0.85, 1.5


@dataclass(frozen=True)
class VramState:
    """One reading: device memory free now and what the engine holds. Tokens and slots are
    counts; bytes per slot and per token convert them."""

    free_bytes: int
    expert_slots: int
    expert_pool: int  # every routed expert of the model: the cache never holds more
    slot_bytes: int
    kv_tokens: int
    kv_token_bytes: int
    kv_floor: int  # tokens the pool never goes below
    kv_live: int  # tokens running requests hold (they cannot be evicted)
    kv_cap: int  # tokens the pool never grows past
    min_expert_slots: int = 1
    max_expert_slots: int | None = None  # rule 3's ceiling (None: the whole pool)
    # the recurrent-state pool (0 everywhere: a model without one, the pool is left alone)
    state_slots: int = 0
    state_slot_bytes: int = 0
    state_floor: int = 0  # slots rule 1 never goes below
    state_live: int = 0  # working states + pinned snapshots (they cannot leave)
    state_cap: int = 0  # rule 3 grows the pool back up to this


@dataclass(frozen=True)
class VramKnobs:
    margin_bytes: int = WORKSPACE_MARGIN_BYTES  # free memory kept for the workspace
    hysteresis_bytes: int = HYSTERESIS_BYTES
    kv_high: float = KV_HIGH
    kv_growth: float = KV_GROWTH


@dataclass(frozen=True)
class VramPlan:
    expert_slots: int
    kv_tokens: int
    reason: str  # memory_claimed | kv_pressure | memory_returned | ctl
    free_bytes: int = 0
    state_slots: int | None = None  # None: keep


def _ceil_div(a: int, b: int) -> int:
    return -(-a // max(1, b))


def _ceiling(s: VramState) -> int:
    top = s.expert_pool if s.max_expert_slots is None else s.max_expert_slots
    return min(s.expert_pool, top)


def plan(s: VramState, k: VramKnobs | None = None) -> VramPlan | None:
    """The sizes for `s` by the rules of the module docstring, or None (keep the current)."""
    k = k or VramKnobs()
    surplus = s.free_bytes - k.margin_bytes
    kv_floor = max(s.kv_floor, s.kv_live)
    if surplus < -k.hysteresis_bytes:
        deficit = -surplus
        slots = max(s.min_expert_slots, s.expert_slots - _ceil_div(deficit, s.slot_bytes))
        deficit -= (s.expert_slots - slots) * s.slot_bytes
        kv = s.kv_tokens
        if deficit > 0:
            kv = max(min(kv, kv_floor), kv - _ceil_div(deficit, s.kv_token_bytes))
            deficit -= (s.kv_tokens - kv) * s.kv_token_bytes
        st = s.state_slots
        if deficit > 0 and s.state_slot_bytes:
            floor = max(s.state_floor, s.state_live)
            st = max(min(st, floor), st - _ceil_div(deficit, s.state_slot_bytes))
        out = VramPlan(slots, kv, "memory_claimed", s.free_bytes, st)
    elif s.kv_live > k.kv_high * s.kv_tokens and s.kv_tokens < s.kv_cap:
        want = min(s.kv_cap, max(s.kv_tokens + 1, math.ceil(s.kv_live * k.kv_growth)))
        need = (want - s.kv_tokens) * s.kv_token_bytes - max(0, surplus)
        slots = s.expert_slots
        if need > 0:
            slots = max(s.min_expert_slots, s.expert_slots - _ceil_div(need, s.slot_bytes))
            short = need - (s.expert_slots - slots) * s.slot_bytes
            if short > 0:  # the experts cannot pay it all: grow as far as they do
                want -= _ceil_div(short, s.kv_token_bytes)
        out = VramPlan(slots, max(s.kv_tokens, want), "kv_pressure", s.free_bytes,
                       s.state_slots)
    elif surplus > k.hysteresis_bytes and (s.expert_slots < _ceiling(s)
                                           or s.state_slots < s.state_cap):
        st = s.state_slots
        if st < s.state_cap and s.state_slot_bytes:
            st += min(s.state_cap - st, surplus // s.state_slot_bytes)
            surplus -= (st - s.state_slots) * s.state_slot_bytes
        add = max(0, min(_ceiling(s) - s.expert_slots, surplus // max(1, s.slot_bytes)))
        out = VramPlan(s.expert_slots + add, s.kv_tokens, "memory_returned", s.free_bytes, st)
    else:
        return None
    if (out.expert_slots, out.kv_tokens, out.state_slots) == (s.expert_slots, s.kv_tokens,
                                                              s.state_slots):
        return None
    return out
