"""What one forward pass needs besides the weights and the cache tensors: the packed batch.

A batch packs the new tokens of B sequences (prefill chunks and decode steps mixed) into one
row-major stream of T tokens. Sequence b owns rows [cu[b], cu[b+1]); its cached prefix has
`prefix_lens[b]` tokens whose K/V sit in the KV pool at `kv_slots[b][:prefix_lens[b]]`, and the
slots for its new tokens are `kv_slots[b][prefix_lens[b]:]`. Models with linear attention also
carry one recurrent-state slot per sequence, read at the start of the chunk and overwritten at
its end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

MOE_MODES = ("eager", "captured", "streamed")


@dataclass(frozen=True)
class MoEStep:
    """How the MoE layers of one forward step run (set by the expert runtime's `step(...)` for
    the engine's steps and by the decode runner for its own; read by every expert backend).

    - `mode`: `eager` (any step run by plain launches; a backend may sync with the host),
      `captured` (a decode step through the runner's static buffers, replayed from a CUDA
      graph or run eagerly through them: a backend issues no host sync where it can, and
      hands its CPU share to `bridge`), `streamed` (a long prefill chunk: every MoE layer
      through the runtime's layer streamer).
    - `row_mask [B]` bool: the real rows of a runner bucket; padding rows route no expert.
    - `bridge`: the runner's CPU bridge (experts/bridge.py) for `captured` steps, or None.
      Typed loosely: this bottom-layer module imports no expert module.
    """

    mode: str = "eager"
    row_mask: torch.Tensor | None = None
    bridge: Any = None

    def __post_init__(self) -> None:
        if self.mode not in MOE_MODES:
            raise ValueError(f"MoEStep.mode must be one of {', '.join(MOE_MODES)}")


EAGER = MoEStep()


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    new_lens: list[int]  # [B] new tokens per sequence (sum = T)
    prefix_lens: list[int]  # [B] tokens already cached per sequence
    kv_slots: list[torch.Tensor]  # B × [prefix+new] int64 slot of every position
    state_slots: list[int]  # [B] recurrent-state slot (models with linear attention; else empty)
    logits_rows: torch.Tensor  # [R] rows of the packed stream whose logits are wanted
    # decode-only steps of the graph runner: device-side inputs the layers read instead of the
    # host lists above (a freetoken.layers.step_context.DecodeContext); None for every other
    # batch. Typed loosely: this bottom-layer module imports no layer.
    ctx: Any = None
    # how the MoE layers run this step (see MoEStep); None: eager
    moe: MoEStep | None = None
    _dev: dict = field(default_factory=dict, repr=False)  # per-step index tensors, built once

    def decode_index(self, device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Sequences feeding one token (decode rows): their batch indices, packed rows [D] and
        state slots [D] on `device`. Built once per step and shared by every linear-attention
        layer: a host-to-device copy per layer would synchronise the GPU each time."""
        if "decode" not in self._dev:
            cu = self.cu
            seqs = [b for b in range(self.num_seqs) if self.new_lens[b] == 1]
            idx = torch.tensor([[cu[b] for b in seqs],
                                [self.state_slots[b] for b in seqs] if self.state_slots
                                else [0] * len(seqs)], dtype=torch.long)
            idx = idx.to(device, non_blocking=True) if device.type == "cuda" else idx
            self._dev["decode"] = (seqs, idx[0], idx[1])
        return self._dev["decode"]

    @property
    def num_seqs(self) -> int:
        return len(self.new_lens)

    @property
    def cu(self) -> list[int]:
        out = [0]
        for n in self.new_lens:
            out.append(out[-1] + n)
        return out

    @staticmethod
    def single(ids: list[int], prefix_len: int, kv_slots: torch.Tensor, state_slot: int | None,
               device: torch.device | str = "cpu", all_logits: bool = False) -> ForwardBatch:
        n = len(ids)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.arange(prefix_len, prefix_len + n, device=device),
            new_lens=[n],
            prefix_lens=[prefix_len],
            kv_slots=[kv_slots.to(device)],
            state_slots=[] if state_slot is None else [state_slot],
            logits_rows=torch.arange(n, device=device) if all_logits
            else torch.tensor([n - 1], device=device),
        )
