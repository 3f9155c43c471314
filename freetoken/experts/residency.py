"""Expert residency table: which logical expert sits in which GPU slot, and the per-step decision.

`S` slots are shared by all MoE layers (one global LRU). A logical expert is identified globally
by `g = layer * E + expert`. The table is three tensors and a clock on one device:

- `slot_owner [S]` int64: global expert id held by the slot, or -1 (empty).
- `expert_slot [L*E]` int64: slot holding the expert, or -1 (not resident). Inverse of slot_owner.
- `slot_last_use [S]` int64: clock value of the last step that used the slot; -1 when empty.
- `clock [1]` int64: ticks once per `decide` call (so layers of one step are ordered too).

Decision contract (`decide_reference` here, `freetoken/kernels/triton/slot_decide.py` on device;
both give exactly the same tensors and leave exactly the same tables):

1. `U` = distinct routed experts of `topk_ids [T, K]` (entries < 0 are padding and ignored).
2. hits = U resident, misses = U not resident.
3. `q = min(nf if nf >= 0 else |misses|, |misses|, S - |hits|)` misses are fetched, where
   nf = `num_fetch` (an int or a one-element tensor) or, given a table `num_fetch [E+1]`,
   nf = num_fetch[|misses|] (a fetch rule per miss count, read on the device): misses
   ordered by (routed count descending, expert id ascending), first q taken.
4. Victims: the q first slots not holding a hit of this step, in the order (age ascending, slot
   index ascending), where age = last_use for an occupied slot and -1 for an empty one (so empty
   slots go first, then least recently used; equal last_use breaks ties by lowest slot index).
   The i-th fetched expert goes to the i-th victim.
5. clock += 1; hit slots and filled slots get last_use = clock; evicted experts lose their slot.
6. `slot_ids [T, K]` = slot of the entry's expert after the update, -1 for CPU-computed and for
   padding; `cpu_mask [T, K]` = valid entry computed on the CPU.

Outputs have fixed sizes so the device version needs no host sync: `fetch_experts [F]` and
`fetch_slots [F]` with `F = min(T*K, E, S)`; the first `counters[2]` entries are valid, the rest
are -1. `counters [3]` int64 = (hits, misses, fetched), counted over distinct experts.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import Tensor

from freetoken.log import get_logger, kv

log = get_logger("experts")

# Sort key for slots/experts excluded from a choice: larger than any real composite key.
EXCLUDED_KEY = 2**62


class Decision(NamedTuple):
    """Result of one layer's decision (see module docstring for the exact contract)."""

    slot_ids: Tensor  # [T, K] int64: slot for GPU-computed entries, -1 otherwise
    cpu_mask: Tensor  # [T, K] bool: valid entries computed on the CPU
    fetch_experts: Tensor  # [F] int64: local expert ids to copy host->GPU, -1 padded
    fetch_slots: Tensor  # [F] int64: destination slots, -1 padded
    counters: Tensor  # [3] int64: hits, misses, fetched (distinct experts)

    @property
    def num_fetched(self) -> int:
        """Host-side count of valid fetch entries (syncs when on a GPU)."""
        return int(self.counters[2])


def fetch_capacity(num_tokens: int, top_k: int, num_experts: int, num_slots: int) -> int:
    """F: the fixed length of the fetch lists (an upper bound on q)."""
    return max(0, min(num_tokens * top_k, num_experts, num_slots))


class ResidencyTable:
    """The residency tables of `S` slots shared by `L` layers of `E` experts each.

    `decide(..., impl="triton")` runs the device kernel (requires triton; on CPU only under
    TRITON_INTERPRET=1). `resize` re-budgets S; it returns the slot moves the weight buffers must
    mirror (see `SlotCache`).
    """

    def __init__(
        self, num_layers: int, num_experts: int, num_slots: int, device: str | torch.device = "cpu"
    ) -> None:
        if num_layers <= 0 or num_experts <= 0 or num_slots < 0:
            raise ValueError(f"bad table shape L={num_layers} E={num_experts} S={num_slots}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.device = torch.device(device)
        i64, dev = torch.int64, self.device
        self.slot_owner = torch.full((num_slots,), -1, dtype=i64, device=dev)  # [S]
        self.expert_slot = torch.full((num_layers * num_experts,), -1, dtype=i64, device=dev)
        self.slot_last_use = torch.full((num_slots,), -1, dtype=i64, device=dev)  # [S]
        self.clock = torch.zeros(1, dtype=i64, device=dev)  # [1]

    @property
    def num_slots(self) -> int:
        return int(self.slot_owner.numel())

    def resident_count(self) -> int:
        return int((self.slot_owner >= 0).sum())

    def decide(
        self, layer: int, topk_ids: Tensor, num_fetch: int | Tensor = -1, impl: str = "reference",
        accumulate: Tensor | None = None,
    ) -> Decision:
        """Decide one layer's step and update the tables (contract in the module docstring).
        `accumulate` [3] int64 on the tables' device: the decision's counters are added to it
        (by the kernel itself under `triton`: no launch of its own in a captured step)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if impl == "reference":
            d = decide_reference(self, layer, topk_ids, num_fetch)
            if accumulate is not None:
                accumulate.add_(d.counters)
            return d
        if impl == "triton":
            from freetoken.kernels.triton.slot_decide import slot_decide

            T, K = topk_ids.shape
            cap = fetch_capacity(T, K, self.num_experts, self.num_slots)
            return Decision(*slot_decide(self.slot_owner, self.expert_slot, self.slot_last_use,
                                         self.clock, self.num_experts, layer, topk_ids, num_fetch,
                                         cap, accumulate=accumulate))
        raise ValueError(f"unknown decide impl {impl!r} (reference|triton)")

    def resize(self, num_slots: int) -> tuple[Tensor, Tensor]:
        """Re-budget to `num_slots` slots; returns `(src_slots [M], dst_slots [M])` moves.

        Grow: new slots are appended empty; no moves. Shrink: the least recently used residents
        are evicted until at most `num_slots` remain (order: age, then slot index, as in decide);
        survivors in slots >= num_slots move to the lowest free slots < num_slots. The caller
        must copy slot weights src -> dst before it drops the tail of its buffers.
        """
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        old = self.num_slots
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if num_slots >= old:
            pad = torch.full((num_slots - old,), -1, dtype=torch.int64, device=self.device)
            self.slot_owner = torch.cat([self.slot_owner, pad])
            self.slot_last_use = torch.cat([self.slot_last_use, pad])
            log.debug(kv("slots_grow", old=old, new=num_slots))
            return empty, empty
        occupied = self.slot_owner >= 0  # [S]
        n_evict = max(0, int(occupied.sum()) - num_slots)
        slots = torch.arange(old, device=self.device)
        if n_evict:
            key = torch.where(occupied, self.slot_last_use * old + slots, EXCLUDED_KEY)
            victims = torch.topk(key, n_evict, largest=False).indices  # [n_evict]
            self.expert_slot[self.slot_owner[victims]] = -1
            self.slot_owner[victims] = -1
            self.slot_last_use[victims] = -1
        occupied = self.slot_owner >= 0
        src = slots[num_slots:][occupied[num_slots:]]  # survivors past the new end
        dst = slots[:num_slots][~occupied[:num_slots]][: src.numel()]  # lowest free slots
        self.slot_owner[dst] = self.slot_owner[src]
        self.slot_last_use[dst] = self.slot_last_use[src]
        self.expert_slot[self.slot_owner[dst]] = dst
        self.slot_owner = self.slot_owner[:num_slots].clone()
        self.slot_last_use = self.slot_last_use[:num_slots].clone()
        log.debug(kv("slots_shrink", old=old, new=num_slots, evicted=n_evict, moved=src.numel()))
        return src, dst


def decide_reference(
    table: ResidencyTable, layer: int, topk_ids: Tensor, num_fetch: int | Tensor = -1
) -> Decision:
    """Plain torch decision (the oracle for the kernel). T tokens, K top-k, E experts, S slots."""
    dev = table.device
    E, S = table.num_experts, table.num_slots
    ids = topk_ids.to(device=dev, dtype=torch.int64)  # [T, K]
    T, K = ids.shape
    F = fetch_capacity(T, K, E, S)
    base = layer * E
    valid = ids >= 0  # [T, K]
    counts = torch.bincount(ids[valid], minlength=E)[:E]  # [E]
    need = counts > 0  # [E]
    slot_of = table.expert_slot[base : base + E]  # [E]
    hit = need & (slot_of >= 0)  # [E]
    miss = need & (slot_of < 0)  # [E]
    n_hit, n_miss = int(hit.sum()), int(miss.sum())
    nf = (int(num_fetch[n_miss]) if isinstance(num_fetch, Tensor) and num_fetch.numel() > 1
          else int(num_fetch))
    q = min(n_miss if nf < 0 else min(nf, n_miss), S - n_hit)

    experts = torch.arange(E, device=dev)  # [E]
    mkey = torch.where(miss, (T * K - counts) * E + experts, EXCLUDED_KEY)  # [E]
    fetch_e = torch.topk(mkey, q, largest=False).values % E  # [q], (count desc, id asc)
    protected = torch.zeros(S, dtype=torch.bool, device=dev)  # [S]
    protected[slot_of[hit]] = True
    age = torch.where(table.slot_owner >= 0, table.slot_last_use, -1)  # [S]
    slots = torch.arange(S, device=dev)  # [S]
    vkey = torch.where(protected, EXCLUDED_KEY, (age + 1) * S + slots)  # [S]
    fetch_s = torch.topk(vkey, q, largest=False).values % S  # [q], (age asc, slot asc)

    table.clock += 1
    now = table.clock[0]
    table.slot_last_use[slot_of[hit]] = now
    old = table.slot_owner[fetch_s]  # [q]
    table.expert_slot[old[old >= 0]] = -1
    table.slot_owner[fetch_s] = base + fetch_e
    table.expert_slot[base + fetch_e] = fetch_s
    table.slot_last_use[fetch_s] = now

    slot_ids = torch.where(valid, table.expert_slot[base + ids.clamp(min=0)], -1)  # [T, K]
    cpu_mask = valid & (slot_ids < 0)  # [T, K]
    fetch_experts = torch.full((F,), -1, dtype=torch.int64, device=dev)  # [F]
    fetch_slots = torch.full((F,), -1, dtype=torch.int64, device=dev)  # [F]
    fetch_experts[:q] = fetch_e
    fetch_slots[:q] = fetch_s
    counters = torch.tensor([n_hit, n_miss, q], dtype=torch.int64, device=dev)  # [3]
    if log.isEnabledFor(logging.DEBUG):
        evicted = int((old >= 0).sum())
        log.debug(kv("decide", layer=layer, hits=n_hit, misses=n_miss, fetched=q, evicted=evicted))
    return Decision(slot_ids, cpu_mask, fetch_experts, fetch_slots, counters)
