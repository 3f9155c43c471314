"""GPU slot cache: the residency table plus the slot weight buffers it indexes.

Contract: after `decide(layer, ids)` followed by `fill(layer, decision.fetch_experts,
decision.fetch_slots, store)`, every entry with `slot_ids >= 0` finds exactly its expert's
weights in `gate_up_slots[slot]` / `down_slots[slot]` (the host store is the source of truth; the
cache changes speed, never results). `resize` keeps that true for every resident expert.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from freetoken.experts.residency import Decision, ResidencyTable
from freetoken.kernels.quant import QuantBank, empty_bank
from freetoken.log import get_logger, kv
from freetoken.types.model_config import ExpertFormat, expert_nbytes

log = get_logger("experts")


class ExpertBanks(Protocol):
    """Host expert pool of one model: per MoE layer, banks in runtime layout."""

    def gate_up(self, layer: int) -> Tensor:
        """[E, 2I, H] gate and up projections of all experts of `layer`."""
        ...

    def down(self, layer: int) -> Tensor:
        """[E, H, I] down projections of all experts of `layer`."""
        ...


class SlotCache:
    """`S` expert slots on `device` shared by all layers, with a global LRU residency table.

    S slots, I expert intermediate, H hidden. `gate_up_slots [S, 2I, H]`, `down_slots [S, H, I]`:
    dense tensors of `dtype`, or with a quantized `fmt` QuantBanks in that format (the slots
    hold the store's bytes as they are; `dtype` is then the activations' dtype).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        hidden: int,
        intermediate: int,
        num_slots: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        impl: str = "reference",
        fmt: ExpertFormat | None = None,
    ) -> None:
        self.table = ResidencyTable(num_layers, num_experts, num_slots, device)
        self.hidden, self.intermediate, self.dtype = hidden, intermediate, dtype
        self.fmt = fmt if fmt is not None and fmt.quantized else None
        self.impl = impl
        self.generation = 0  # bumped whenever the slot buffers are reallocated (resize)
        self.gate_up_slots = self._alloc_gate_up(num_slots)  # [S, 2I, H]
        self.down_slots = self._alloc_down(num_slots)  # [S, H, I]

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    def slot_bytes(self) -> int:
        """Bytes of one slot (gate_up + down of one expert)."""
        return expert_nbytes(self.hidden, self.intermediate, self.fmt or self.dtype)

    def _alloc(self, n: int, rows: int, cols: int, halves: int) -> Tensor | QuantBank:
        if self.fmt is not None:
            return empty_bank(self.fmt.name, n, rows, cols, halves, self.fmt.block, self.device)
        return torch.zeros((n, rows, cols), dtype=self.dtype, device=self.device)

    def _alloc_gate_up(self, n: int) -> Tensor | QuantBank:
        return self._alloc(n, 2 * self.intermediate, self.hidden, 2)

    def _alloc_down(self, n: int) -> Tensor | QuantBank:
        return self._alloc(n, self.hidden, self.intermediate, 1)

    def decide(self, layer: int, topk_ids: Tensor, num_fetch: int | Tensor = -1,
               accumulate: Tensor | None = None) -> Decision:
        """The layer's decision (see residency.py); call `fill` with its fetch lists next.
        `accumulate` [3]: (hits, misses, fetched) added to it on the device."""
        return self.table.decide(layer, topk_ids, num_fetch, impl=self.impl,
                                 accumulate=accumulate)

    def fill(
        self, layer: int, fetch_experts: Tensor, fetch_slots: Tensor, store: ExpertBanks
    ) -> int:
        """Copy the fetched experts of `layer` from `store` into their slots; returns q.

        `fetch_experts [F]` / `fetch_slots [F]` are a decision's padded lists (-1 past q). This
        host-driven copy reads q on the host (a sync); a graph-captured decode would gather from
        pinned host memory in a kernel instead.
        """
        valid = fetch_slots >= 0  # [F]
        experts = fetch_experts[valid].tolist()  # [q] host indices into the banks
        slots = fetch_slots[valid].tolist()  # [q]
        gate_up = store.gate_up(layer)  # [E, 2I, H]
        down = store.down(layer)  # [E, H, I]
        # one DMA per bank row straight from the (pinned) store: gathering the rows into a
        # temporary first would be a CPU memcpy into pageable memory at a fraction of the link
        for e, s in zip(experts, slots):
            self.gate_up_slots[s].copy_(gate_up[e], non_blocking=True)
            self.down_slots[s].copy_(down[e], non_blocking=True)
        if experts:
            log.debug(kv("fill", layer=layer, experts=experts, slots=slots))
        return len(experts)

    def can_fill_on_device(self, store: ExpertBanks) -> bool:
        """Whether `fill_device` applies: a CUDA cache over a pinned host store, with triton
        (dense slots or quantized ones: codes and scales both travel by UVA)."""
        if self.device.type != "cuda" or not getattr(store, "pinned", False):
            return False
        try:
            import freetoken.kernels.triton.uva_fill  # noqa: F401
        except (ImportError, RuntimeError):
            return False
        return True

    def fill_device(self, layer: int, fetch_experts: Tensor, fetch_slots: Tensor,
                    store: ExpertBanks) -> None:
        """`fill` without leaving the device: a kernel reads the chosen experts from the pinned
        store through its mapped address into their slots (padding entries are skipped on the
        device), so nothing syncs and the call can be captured in a CUDA graph."""
        from freetoken.kernels.triton.uva_fill import fill_banks, fill_pair

        fill = fill_banks if isinstance(self.gate_up_slots, QuantBank) else fill_pair
        fill(store.gate_up(layer), self.gate_up_slots, store.down(layer), self.down_slots,
             fetch_experts, fetch_slots)

    def resize(self, num_slots: int) -> None:
        """Re-budget to `num_slots` slots at run time, all or nothing.

        The new buffers are allocated before anything changes, so an allocation failure (a GPU
        out of memory) raises with the cache exactly as it was. Shrink evicts the least recently
        used experts first and compacts survivors into the kept slots (their weights move with
        them); grow adds empty slots. Resident experts keep correct weights either way; slot
        indices from earlier decisions are void afterwards. Peak memory is old + new buffers.
        """
        old = self.num_slots
        if num_slots == old:
            return
        if num_slots < 1:
            raise ValueError("a slot cache needs at least one slot")
        gate_up, down = self._alloc_gate_up(num_slots), self._alloc_down(num_slots)  # may raise
        keep = min(old, num_slots)
        src, dst = self.table.resize(num_slots)  # [M], [M] survivor moves (shrink only)
        gate_up[:keep] = self.gate_up_slots[:keep]
        down[:keep] = self.down_slots[:keep]
        if src.numel():
            gate_up[dst] = self.gate_up_slots[src]
            down[dst] = self.down_slots[src]
        self.gate_up_slots, self.down_slots = gate_up, down
        self.generation += 1  # captured decode graphs hold the old buffers: capture anew
        log.info(kv("slot_cache_resize", old=old, new=num_slots, moved=int(src.numel()),
                    resident=self.table.resident_count()))
