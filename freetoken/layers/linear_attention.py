"""Gated DeltaNet linear attention (qwen3_next / qwen3_5) with its causal depthwise conv.

Weights in the qwen3_5 layout (qwen3_next's fused in_proj_qkvz/ba are converted at load):
in_proj_qkv [2·Hk·dk + Hv·dv, H] rows [q all heads | k | v]; in_proj_z [Hv·dv, H];
in_proj_b, in_proj_a [Hv, H]; conv1d [C, 1, Kc] over C = 2·Hk·dk + Hv·dv channels.
Shapes below: T packed tokens, n one sequence's tokens, C conv channels, Kc conv kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.cache.tensors import StateTensors
from freetoken.layers import fast_ops
from freetoken.layers.gated_delta import chunk_gated_delta, recurrent_gated_delta
from freetoken.layers.linear import Linear, fuse_linears, split_linear
from freetoken.layers.norm import GatedRMSNorm
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ModelConfig


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kc = cfg.linear_conv_kernel
        H = cfg.hidden_size
        self.in_proj_qkv = Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = Linear(H, self.value_dim, bias=False)
        self.in_proj_b = Linear(H, self.hv, bias=False)
        self.in_proj_a = Linear(H, self.hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.kc))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, H, bias=False)
        self.fused_in: torch.Tensor | None = None  # see fuse_projections
        self.in_sizes = [self.conv_dim, self.value_dim, self.hv, self.hv]

    def fuse_projections(self) -> None:
        self.fused_in = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                      self.in_proj_a])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: StateTensors) -> torch.Tensor:
        T = x.shape[0]
        li = pool.layer_index[self.layer_id]
        conv_pool, ssm_pool = pool.conv[li], pool.ssm[li]  # [S, C, Kc-1], [S, Hv, dk, dv]
        if self.fused_in is not None:  # one GEMM for the four input projections
            mixed, z, b, a = split_linear(x, self.fused_in, self.in_sizes)
        else:
            mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)  # [T, C], [T, Hv·dv]
            b, a = self.in_proj_b(x), self.in_proj_a(x)  # [T, Hv]
        z = z.reshape(T, self.hv, self.dv)  # [T, Hv, dv]
        w = self.conv1d.weight[:, 0, :]  # [C, Kc]

        if batch.ctx is not None:  # decode-only step: state read and written in place
            slots = batch.ctx.state_slots  # [B]
            conv_out = fast_ops.conv_update(mixed, conv_pool, w, slots)  # [B, C]
            q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], -1)
            # the gates from a, b inside the recurrent step's launch
            o = fast_ops.gdn_recurrent(q.view(T, self.hk, self.dk), k.view(T, self.hk, self.dk),
                                       v.reshape(T, self.hv, self.dv), a, b, ssm_pool, slots,
                                       gates=(self.A_log, self.dt_bias))  # [B, Hv, dv] fp32
            y = self.norm(o, z, x.dtype)  # [B, Hv, dv]
            return self.out_proj(y.reshape(T, self.value_dim))
        g, beta = fast_ops.gdn_gates(a, b, self.A_log, self.dt_bias)  # [T, Hv] each
        core = torch.empty(T, self.hv, self.dv, dtype=torch.float32, device=x.device)  # [T, Hv, dv]
        cu = batch.cu
        decode, rows, slots = batch.decode_index(x.device)  # [D] packed rows, [D] state slots
        if decode:
            window = torch.cat([conv_pool[slots], mixed[rows, :, None].to(conv_pool.dtype)],
                               -1)  # [B, C, Kc]
            conv_pool[slots] = window[..., 1:]
            conv_out = F.silu((window.to(w.dtype) * w).sum(-1)).to(x.dtype)  # [B, C]
            q, k, v = self._split(conv_out)
            o, s = recurrent_gated_delta(q, k, v, g[rows], beta[rows], ssm_pool[slots])
            ssm_pool[slots] = s
            core[rows] = o
        for b in range(batch.num_seqs):
            if batch.new_lens[b] == 1:
                continue
            lo, hi, slot = cu[b], cu[b + 1], batch.state_slots[b]
            xs = torch.cat([conv_pool[slot], mixed[lo:hi].t().to(conv_pool.dtype)],
                           -1)  # [C, Kc-1+n]
            conv_pool[slot] = xs[:, -(self.kc - 1):]
            conv_out = F.silu(F.conv1d(xs[None].to(w.dtype), w[:, None, :],
                                       groups=self.conv_dim))[0].t().to(x.dtype)  # [n, C]
            q, k, v = self._split(conv_out)
            o, s = chunk_gated_delta(q, k, v, g[lo:hi], beta[lo:hi], ssm_pool[slot])
            ssm_pool[slot] = s
            core[lo:hi] = o
        y = self.norm(core, z, x.dtype)  # [T, Hv, dv]
        return self.out_proj(y.reshape(T, self.value_dim))

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # conv_out [n, C] -> q, k [n, Hv, dk] (L2-normalised, each K-head serving Hv/Hk
        # consecutive value heads), v [n, Hv, dv]
        n = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = self.hv // self.hk
        q = _l2norm(q.float().view(n, self.hk, self.dk)).repeat_interleave(r, dim=1)
        k = _l2norm(k.float().view(n, self.hk, self.dk)).repeat_interleave(r, dim=1)
        return q, k, v.reshape(n, self.hv, self.dv)
