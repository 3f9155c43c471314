"""GQA full attention over the paged KV pool, with q/k norm and (qwen3_next / 3.5) a sigmoid
gate on the output.

Shapes: T packed new tokens, Hq query heads, Hk KV heads, D head_dim, L context of one sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine.forward_batch import ForwardBatch, KVPool
from freetoken.layers.linear import Linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import apply_rotary
from freetoken.models.config import ModelConfig
from kernels.cpu.attention_ops import cpu_decode_attention


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.hq, self.hk, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gated = cfg.attn_output_gate
        q_out = self.hq * self.d * (2 if self.gated else 1)
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.hk * self.d, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.hk * self.d, bias=bias)
        self.o_proj = Linear(self.hq * self.d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, cfg.zero_centered_norm)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, cfg.zero_centered_norm)
        self.scale = self.d ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        T = x.shape[0]
        if self.gated:
            qg = self.q_proj(x).view(T, self.hq, 2 * self.d)  # [T, Hq, 2D]: per head [q | gate]
            q, gate = qg[..., : self.d], qg[..., self.d:].reshape(T, self.hq * self.d)
        else:
            q, gate = self.q_proj(x).view(T, self.hq, self.d), None
        q = apply_rotary(self.q_norm(q), cos, sin)  # [T, Hq, D]
        k = apply_rotary(self.k_norm(self.k_proj(x).view(T, self.hk, self.d)), cos, sin)  # [T, Hk, D]
        v = self.v_proj(x).view(T, self.hk, self.d)  # [T, Hk, D]

        li = kv.layer_index[self.layer_id]
        k_pool, v_pool = kv.k[li], kv.v[li]  # [S, Hk, D]
        if batch.ctx is not None:  # decode-only step: device slots, attention planned per step
            k_pool.index_copy_(0, batch.ctx.out_slots, k.to(k_pool.dtype))
            v_pool.index_copy_(0, batch.ctx.out_slots, v.to(v_pool.dtype))
            out = batch.ctx.attn.run(q, k_pool, v_pool, self.scale)  # [B, Hq, D]
            return self._out(out, gate)
        out = torch.empty(T, self.hq, self.d, dtype=x.dtype, device=x.device)  # [T, Hq, D]
        cu = batch.cu
        for b in range(batch.num_seqs):
            lo, hi, p = cu[b], cu[b + 1], batch.prefix_lens[b]
            slots = batch.kv_slots[b]  # [p + n]
            k_pool[slots[p:]] = k[lo:hi].to(k_pool.dtype)
            v_pool[slots[p:]] = v[lo:hi].to(v_pool.dtype)
            if hi - lo == 1:  # decode row on the CPU at length: read the pool in place
                o1 = cpu_decode_attention(q[lo], k_pool, v_pool, slots, self.scale)
                if o1 is not None:
                    out[lo] = o1.to(out.dtype)
                    continue
            out[lo:hi] = self._attend(q[lo:hi], k_pool[slots], v_pool[slots], p)
        return self._out(out, gate)

    def _out(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        # out [T, Hq, D] -> [T, hidden]
        o = out.reshape(out.shape[0], self.hq * self.d)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
        # q [n, Hq, D]; k, v [L, Hk, D] with L = prefix + n; query i sees keys j <= prefix + i
        n, L = q.shape[0], k.shape[0]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n|L, D]
        mask = None
        if n > 1:
            mask = torch.arange(L, device=q.device)[None, :] <= (
                prefix + torch.arange(n, device=q.device)[:, None])  # [n, L]
        o = F.scaled_dot_product_attention(
            qh.unsqueeze(0), kh.unsqueeze(0).to(q.dtype), vh.unsqueeze(0).to(q.dtype),
            attn_mask=mask, scale=self.scale, enable_gqa=self.hq != self.hk,
        )  # [1, Hq, n, D]
        return o[0].transpose(0, 1)  # [n, Hq, D]
