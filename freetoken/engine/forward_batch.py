"""What one forward pass needs besides the weights: the packed batch and the cache tensors.

A batch packs the new tokens of B sequences (prefill chunks and decode steps mixed) into one
row-major stream of T tokens. Sequence b owns rows [cu[b], cu[b+1]); its cached prefix has
`prefix_lens[b]` tokens whose K/V sit in the KV pool at `kv_slots[b][:prefix_lens[b]]`, and the
slots for its new tokens are `kv_slots[b][prefix_lens[b]:]`. Hybrid models also carry one
recurrent-state slot per sequence, read at the start of the chunk and overwritten at its end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from freetoken.models.config import ModelConfig

if TYPE_CHECKING:  # the layers' type; the batch description itself imports no layer
    from freetoken.layers.step_context import DecodeContext


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    new_lens: list[int]  # [B] new tokens per sequence (sum = T)
    prefix_lens: list[int]  # [B] tokens already cached per sequence
    kv_slots: list[torch.Tensor]  # B × [prefix+new] int64 slot of every position
    state_slots: list[int]  # [B] recurrent-state slot (hybrid models; else empty)
    logits_rows: torch.Tensor  # [R] rows of the packed stream whose logits are wanted
    # decode-only steps of the graph runner: device-side inputs the layers read instead of the
    # host lists above (see freetoken/layers/step_context.py); None for every other batch
    ctx: DecodeContext | None = None
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


class KVPool:
    """K/V of every full-attention layer, one slot per token (page size 1).

    k[l], v[l]: [num_slots, Hkv, D] for the l-th full-attention layer.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        n_layers = len(cfg.full_attention_layers)
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
        self.num_slots = num_slots
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.layer_index = {layer: i for i, layer in enumerate(cfg.full_attention_layers)}

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        el = torch.empty((), dtype=dtype).element_size()
        return 2 * len(cfg.full_attention_layers) * cfg.num_kv_heads * cfg.head_dim * el


class StateTensors:
    """Recurrent state of every linear-attention layer, one slot per live sequence or snapshot.

    conv[l]: [num_slots, conv_dim, K-1] (model dtype) — the last K-1 conv inputs.
    ssm[l]:  [num_slots, Hv, dk, dv] float32 — the gated-delta-rule state.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        n_layers = len(cfg.linear_attention_layers)
        self.num_slots = num_slots
        conv_shape = (num_slots, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1)
        ssm_shape = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
        self.conv = [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.ssm = [torch.zeros(ssm_shape, dtype=torch.float32, device=device) for _ in range(n_layers)]
        self.layer_index = {layer: i for i, layer in enumerate(cfg.linear_attention_layers)}

    def reset(self, slot: int) -> None:
        for c, s in zip(self.conv, self.ssm):
            c[slot].zero_()
            s[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        for c, s in zip(self.conv, self.ssm):
            c[dst].copy_(c[src])
            s[dst].copy_(s[src])

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        el = torch.empty((), dtype=dtype).element_size()
        conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel - 1) * el
        ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        return len(cfg.linear_attention_layers) * (conv + ssm)


@dataclass
class Caches:
    kv: KVPool
    state: StateTensors | None
