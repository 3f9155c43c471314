"""Device-side inputs of a decode-only step: what the layers read instead of host lists, so the
whole step can be captured once in a CUDA graph and replayed (freetoken/engine/graph_runner.py).

A decode step feeds one token for each of B sequences. Everything a layer needs beyond its
weights and the pools sits in device tensors of fixed size that the runner rewrites in place
before each replay:

- `out_slots [B]` int64: the KV-pool slot of each row's new token (attention layers write K/V
  there with `index_copy_`);
- `state_slots [B]` int64: each row's recurrent-state slot (gated DeltaNet layers read and write
  their conv and SSM state there in place);
- `attn`: a `PagedDecode` planned for this step (which pool slots each row attends over).

The real rows of a bucket (its padding rows route no expert) travel in the batch's `MoEStep`
(freetoken/types/forward_batch.py), with how the MoE layers run the step.

Shapes: B rows, Hq query heads, Hk KV heads, D head dim, S pool slots, L keys of one row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from freetoken.kernels.cpu.attention_ops import cpu_decode_attention


class PagedDecode:
    """Decode attention over the paged pool for one step. Contract: `run(q [B, Hq, D], k_pool,
    v_pool [S, Hk, D], scale) -> [B, Hq, D]` in q's dtype, row b attending over the pool slots the
    step was planned with (its whole context, the new token included, whose K/V the layer wrote
    before calling). Implementations may keep per-step plans; `run` issues no host sync."""

    name = "base"

    def run(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, scale: float) -> Tensor:
        raise NotImplementedError


class TorchPagedDecode(PagedDecode):
    """Reference and CPU path: each row's keys are its slot list (host-side row tensors); rows
    with many keys on the CPU read the pool in place through the C++ kernel, the rest gather and
    run SDPA. Not capturable (one loop iteration per row)."""

    name = "torch"

    def __init__(self, rows: list[Tensor]):
        self.rows = rows  # B × [L_b] int64 slots

    def run(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, scale: float) -> Tensor:
        out = torch.empty_like(q)  # [B, Hq, D]
        for b, slots in enumerate(self.rows):
            o1 = cpu_decode_attention(q[b], k_pool, v_pool, slots, scale)
            if o1 is None:
                o1 = attend(q[b:b + 1], k_pool[slots], v_pool[slots], slots.numel() - 1,
                            scale)[0]
            out[b] = o1.to(out.dtype)
        return out


def attend(q: Tensor, k: Tensor, v: Tensor, prefix: int, scale: float) -> Tensor:
    """Causal attention of n new queries over their sequence's gathered keys: q [n, Hq, D];
    k, v [L, Hk, D] with L = prefix + n; query i sees keys j <= prefix + i. -> [n, Hq, D]."""
    n, L = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n|L, D]
    mask, causal = None, False
    if n > 1 and q.is_cuda:
        # no [n, L] mask (the math kernel, 8 GB of scores for a 4k chunk after 28k): a first
        # chunk takes the flash kernel, a later one the memory-efficient kernel through a
        # lower-right causal bias (query i sees keys j <= prefix + i), heads expanded for it
        if prefix == 0:
            causal = True
        else:
            from torch.nn.attention.bias import causal_lower_right

            r = q.shape[1] // k.shape[1]
            kh, vh = kh.repeat_interleave(r, 0), vh.repeat_interleave(r, 0)
            mask = causal_lower_right(n, L)
    elif n > 1:
        mask = torch.arange(L, device=q.device)[None, :] <= (
            prefix + torch.arange(n, device=q.device)[:, None])  # [n, L]
    o = F.scaled_dot_product_attention(
        qh.unsqueeze(0), kh.unsqueeze(0).to(q.dtype), vh.unsqueeze(0).to(q.dtype),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=qh.shape[0] != kh.shape[0],
    )  # [1, Hq, n, D]
    return o[0].transpose(0, 1)  # [n, Hq, D]


@dataclass
class DecodeContext:
    """The device-side inputs of one decode-only step (see the module docstring)."""

    out_slots: Tensor  # [B] int64
    state_slots: Tensor | None  # [B] int64 (models with linear attention), else None
    attn: PagedDecode
