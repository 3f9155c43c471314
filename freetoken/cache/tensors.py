"""The device tensors that cache slot ids index: K/V per token slot, recurrent state per state slot.

The allocators (`SlotAllocator`, `StatePool`) and the radix caches only hand out integer ids;
these classes own the memory those ids address. `Caches` is what a model forward receives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.types.model_config import ModelConfig


class KVPool:
    """K/V of every full-attention layer, one slot per token (page size 1).

    k[l], v[l]: [num_slots, Hkv, D] for the l-th full-attention layer. For multi-head latent
    attention (`cfg.kv_entry`) k[l] is [num_slots, 1, kv_lora_rank + rope dim], the latent, and
    v[l] is empty ([num_slots, 1, 0]): values are read from the latent.
    """

    def __init__(
        self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ):
        n_layers = len(cfg.full_attention_layers)
        heads, dk, dv = cfg.kv_entry
        self.num_slots = num_slots
        self.k = [torch.zeros(num_slots, heads, dk, dtype=dtype, device=device)
                  for _ in range(n_layers)]
        self.v = [torch.zeros(num_slots, heads, dv, dtype=dtype, device=device)
                  for _ in range(n_layers)]
        self.layer_index = {layer: i for i, layer in enumerate(cfg.full_attention_layers)}

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        el = torch.empty((), dtype=dtype).element_size()
        heads, dk, dv = cfg.kv_entry
        return len(cfg.full_attention_layers) * heads * (dk + dv) * el


class StateTensors:
    """Recurrent state of every linear-attention layer, one slot per live sequence or snapshot.

    conv[l]: [num_slots, conv_dim, K-1] (model dtype) — the last K-1 conv inputs.
    ssm[l]:  [num_slots, Hv, dk, dv] float32 — the gated-delta-rule state.
    """

    def __init__(
        self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ):
        n_layers = len(cfg.linear_attention_layers)
        self.num_slots = num_slots
        conv_shape = (num_slots, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1)
        ssm_shape = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
        self.conv = [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.ssm = [
            torch.zeros(ssm_shape, dtype=torch.float32, device=device) for _ in range(n_layers)
        ]
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
