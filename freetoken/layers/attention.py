"""GQA full attention over the paged KV pool, with q/k norm and (qwen3_next / 3.5) a sigmoid
gate on the output.

Shapes: T packed new tokens, Hq query heads, Hk KV heads, D head_dim, L context of one sequence.
"""
from __future__ import annotations

import torch
from torch import nn

from freetoken.cache.tensors import KVPool
from freetoken.kernels import dispatch
from freetoken.kernels.cpu.attention_ops import cpu_decode_attention
from freetoken.layers import fast_ops
from freetoken.layers.linear import Linear, fuse_linears, split_linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import apply_rotary
from freetoken.layers.step_context import attend
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ModelConfig


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
        self.fused_qkv: torch.Tensor | None = None  # see fuse_projections
        self.qkv_sizes = [q_out, self.hk * self.d, self.hk * self.d]

    def fuse_projections(self) -> None:
        self.fused_qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        T = x.shape[0]
        if self.fused_qkv is not None:  # one GEMM for q, k and v
            qp, kp, vp = split_linear(x, self.fused_qkv, self.qkv_sizes)
        else:
            qp, kp, vp = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.gated:
            qg = qp.reshape(T, self.hq, 2 * self.d)  # [T, Hq, 2D]: per head [q | gate]
            q, gate = qg[..., : self.d], qg[..., self.d:]  # [T, Hq, D] views
        else:
            q, gate = qp.reshape(T, self.hq, self.d), None
        q = self._norm_rope(self.q_norm, q, cos, sin)  # [T, Hq, D]
        kr = kp.reshape(T, self.hk, self.d)  # [T, Hk, D] before norm and rotary
        v = vp.reshape(T, self.hk, self.d)  # [T, Hk, D]

        li = kv.layer_index[self.layer_id]
        k_pool, v_pool = kv.k[li], kv.v[li]  # [S, Hk, D]
        if batch.ctx is not None:  # decode-only step: device slots, attention planned per step
            self._store_kv(kr, v, cos, sin, k_pool, v_pool, batch.ctx.out_slots)
            out = batch.ctx.attn.run(q, k_pool, v_pool, self.scale)  # [B, Hq, D]
            return self._out(out, gate)
        k = self._norm_rope(self.k_norm, kr, cos, sin)  # [T, Hk, D]
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
            out[lo:hi] = attend(q[lo:hi], k_pool[slots], v_pool[slots], p, self.scale)
        return self._out(out, gate)

    @staticmethod
    def _norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> torch.Tensor:
        # per-head norm then partial rotary; one launch on CUDA
        mod = dispatch.triton_for(x, "norm")
        if mod is not None:
            return mod.rmsnorm_rope(x, norm.weight, norm.eps, norm.zero_centered, cos, sin)
        return apply_rotary(norm(x), cos, sin)

    def _store_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
        """k_pool[slots] = rope(k_norm(k)), v_pool[slots] = v: k, v [T, Hk, D]. One launch on
        CUDA when the pools hold the dtype the prologue returns (no second rounding)."""
        mod = dispatch.triton_for(k, "norm")
        n = self.k_norm
        if (mod is not None and mod.rope_dtype(k, n.weight, n.zero_centered, cos)
                == k_pool.dtype == v_pool.dtype):
            mod.rmsnorm_rope_store(k, n.weight, n.eps, n.zero_centered, cos, sin, v, k_pool,
                                   v_pool, slots)
            return
        kn = self._norm_rope(n, k, cos, sin)  # [T, Hk, D]
        k_pool.index_copy_(0, slots, kn.to(k_pool.dtype))
        v_pool.index_copy_(0, slots, v.to(v_pool.dtype))

    def _out(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        # out [T, Hq, D], gate [T, Hq, D] (a view) -> [T, hidden]
        if gate is not None:
            return self.o_proj(fast_ops.sigmoid_gate_mul(out, gate))
        return self.o_proj(out.reshape(out.shape[0], self.hq * self.d))
