"""Kimi Delta Attention (kimi_linear's linear-attention layers) over the recurrent-state pool.

Like gated DeltaNet (freetoken/layers/linear_attention.py) with: separate q/k/v projections and
short depthwise convolutions (run as one conv over [q | k | v], the pool's conv state holding its
last Kc-1 inputs), a per-channel forget gate g = -exp(A_log)·softplus(f_b(f_a(x)) + dt_bias)
[Hl, d], beta = σ(b_proj x), and an output RMSNorm gated by σ(g_b(g_a(x))). The pool's state
slots are the same as gated DeltaNet's (`StateTensors` with Hk = Hv = Hl, dk = dv = d), so the
hybrid cache snapshots KDA state at the same anchors.

Shapes: T packed tokens, n one sequence's tokens, B decode rows, Hl heads, d head dim,
C = 3·Hl·d conv channels, Kc conv kernel, S state slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.cache.tensors import StateTensors
from freetoken.layers import fast_ops
from freetoken.layers.fp32 import KeepFp32
from freetoken.layers.kda_rule import chunk_kda
from freetoken.layers.linear import Linear, fuse_linears, split_linear
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ModelConfig


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class _Weight(nn.Module):
    """A submodule holding one `weight` (the checkpoint's `q_conv1d.weight`, `o_norm.weight`)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))


class KimiDeltaAttention(KeepFp32):
    fp32_params = ("dt_bias",)  # as transformers keeps it
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.h, self.d = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.dim, self.kc = self.h * self.d, cfg.linear_conv_kernel
        H = cfg.hidden_size
        self.q_proj = Linear(H, self.dim, bias=False)
        self.k_proj = Linear(H, self.dim, bias=False)
        self.v_proj = Linear(H, self.dim, bias=False)
        self.q_conv1d, self.k_conv1d = _Weight(self.dim, 1, self.kc), _Weight(self.dim, 1, self.kc)
        self.v_conv1d = _Weight(self.dim, 1, self.kc)
        self.f_a_proj = Linear(H, self.d, bias=False)
        self.f_b_proj = Linear(self.d, self.dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.h, 1))
        self.b_proj = Linear(H, self.h, bias=False)
        self.g_a_proj = Linear(H, self.d, bias=False)
        self.g_b_proj = Linear(self.d, self.dim, bias=False)
        self.o_norm = _Weight(self.d)
        self.eps = cfg.rms_norm_eps
        self.o_proj = Linear(self.dim, H, bias=False)
        self.fused_in: torch.Tensor | None = None  # see fuse_projections
        self.in_sizes = [self.dim] * 3 + [self.d, self.h, self.d]

    def fuse_projections(self) -> None:
        """The six projections of x (q, k, v, f_a, b, g_a): one GEMM."""
        self.fused_in = fuse_linears([self.q_proj, self.k_proj, self.v_proj, self.f_a_proj,
                                      self.b_proj, self.g_a_proj])

    def _inputs(self, x: torch.Tensor):
        """x [T, H] -> mixed [T, C] (pre-conv q|k|v), g [T, Hl, d] fp32, beta [T, Hl],
        gate [T, Hl, d]."""
        T = x.shape[0]
        if self.fused_in is not None:
            q, k, v, fa, b, ga = split_linear(x, self.fused_in, self.in_sizes)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            fa, b, ga = self.f_a_proj(x), self.b_proj(x), self.g_a_proj(x)
        g = F.softplus(self.f_b_proj(fa).float() + self.dt_bias.float())  # [T, C/3]
        g = -self.A_log.float().view(self.h, 1).exp() * g.view(T, self.h, self.d)
        gate = self.g_b_proj(ga).view(T, self.h, self.d)
        return torch.cat([q, k, v], -1), g, torch.sigmoid(b), gate

    def _split(self, conv_out: torch.Tensor):
        # conv_out [n, C] -> q, k [n, Hl, d] L2-normalised fp32, v [n, Hl, d]
        n = conv_out.shape[0]
        q, k, v = conv_out.view(n, 3, self.h, self.d).unbind(1)
        return _l2norm(q.float()), _l2norm(k.float()), v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: StateTensors) -> torch.Tensor:
        T = x.shape[0]
        li = pool.layer_index[self.layer_id]
        conv_pool, ssm_pool = pool.conv[li], pool.ssm[li]  # [S, C, Kc-1], [S, Hl, d, d]
        mixed, g, beta, gate = self._inputs(x)
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight,
                       self.v_conv1d.weight])[:, 0, :]  # [C, Kc]
        core = torch.empty(T, self.h, self.d, dtype=torch.float32, device=x.device)
        if batch.ctx is not None:  # decode-only step of the runner: every row, slots on device
            self._decode(mixed, g, beta, w, conv_pool, ssm_pool,
                         torch.arange(T, device=x.device), batch.ctx.state_slots, core, x.dtype)
            return self._out(core, gate, x.dtype)
        decode, rows, slots = batch.decode_index(x.device)
        if decode:
            self._decode(mixed, g, beta, w, conv_pool, ssm_pool, rows, slots, core, x.dtype)
        cu = batch.cu
        for b in range(batch.num_seqs):
            if batch.new_lens[b] == 1:
                continue
            lo, hi, slot = cu[b], cu[b + 1], batch.state_slots[b]
            xs = torch.cat([conv_pool[slot], mixed[lo:hi].t().to(conv_pool.dtype)],
                           -1)  # [C, Kc-1+n]
            conv_pool[slot] = xs[:, -(self.kc - 1):]
            conv_out = F.silu(F.conv1d(xs[None].to(w.dtype), w[:, None, :],
                                       groups=w.shape[0]))[0].t().to(x.dtype)  # [n, C]
            q, k, v = self._split(conv_out)
            o, s = chunk_kda(q, k, v, g[lo:hi], beta[lo:hi], ssm_pool[slot])
            ssm_pool[slot] = s
            core[lo:hi] = o
        return self._out(core, gate, x.dtype)

    def _decode(self, mixed, g, beta, w, conv_pool, ssm_pool, rows, slots, core, dtype) -> None:
        """Decode rows `rows` [B] of the packed stream, their states at `slots` [B], read and
        written in place (`fast_ops`: our Triton kernels on CUDA, torch otherwise)."""
        conv_out = fast_ops.conv_update(mixed[rows].contiguous(), conv_pool, w.contiguous(),
                                        slots).to(dtype)  # [B, C]
        q, k, v = self._split(conv_out)
        core[rows] = fast_ops.kda_recurrent(q.contiguous(), k.contiguous(), v.contiguous(),
                                            g[rows].contiguous(), beta[rows].contiguous(),
                                            ssm_pool, slots)

    def _out(self, core: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """core [T, Hl, d] fp32 -> o_proj(norm(core)·w·σ(gate)) [T, H]; the norm in fp32 on
        core rounded to the model dtype first (as transformers)."""
        c = core.to(dtype).float()
        c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.eps)
        y = (c * self.o_norm.weight.float() * torch.sigmoid(gate.float())).to(dtype)
        return self.o_proj(y.reshape(core.shape[0], self.dim))
