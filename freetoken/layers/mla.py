"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV pool.

Each token's pool entry is its compressed latent, one "head" [kv_lora_rank | rope]: the
normalised c_kv (kv_a_layernorm) and the rotated shared rope key, what transformers caches.
Keys and values are never stored per head:

- prefill (a chunk of n > 1 new tokens) runs the plain form: the sequence's latents are expanded
  through kv_b_proj into per-head k_nope and v, then causal attention over [k_nope | k_rope];
- decode (one new token) runs the absorbed form: W_UK is folded into the query,
  q_lat = [q_nope·W_UK | q_rope] [Hq, C+R], so attention is one-KV-head attention over the latents
  themselves (values: the same latents, of which the first C dims are kept), then W_UV maps the
  result to v. The C++ decode kernel reads the pool in place for it (k_pool = v_pool = latents).

Shapes: T packed new tokens, Hq heads, N qk_nope_head_dim, R qk_rope_head_dim, C kv_lora_rank,
Dv v_head_dim, L context of one sequence, S pool slots, H hidden.
"""
from __future__ import annotations

import torch
from torch import nn

from freetoken.cache.tensors import KVPool
from freetoken.kernels.cpu.attention_ops import cpu_decode_attention
from freetoken.layers.linear import Linear, fuse_linears, split_linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope_scaling import apply_rotary_interleaved, yarn_mscale
from freetoken.layers.rotary import apply_rotary
from freetoken.layers.step_context import attend
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ModelConfig

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not rms_norm_eps
_LORA_NORM_EPS = 1e-6


def mla_scale(cfg: ModelConfig) -> float:
    """Softmax scale: (N + R)^-0.5, times yarn_mscale(factor, mscale_all_dim)² under YaRN."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = dict(cfg.rope_scaling)
    if rs.get("rope_type", "default") != "default" and rs.get("mscale_all_dim"):
        m = yarn_mscale(rs["factor"], rs["mscale_all_dim"])
        scale = scale * m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.hq, self.n, self.r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.c, self.dv = cfg.kv_lora_rank, cfg.v_head_dim
        q_out = self.hq * (self.n + self.r)
        self.q_lora = cfg.q_lora_rank
        if self.q_lora:
            self.q_a_proj = Linear(H, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, _LORA_NORM_EPS, False)
            self.q_b_proj = Linear(self.q_lora, q_out, bias=False)
        else:
            self.q_proj = Linear(H, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(H, self.c + self.r, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.c, _LORA_NORM_EPS, False)
        self.kv_b_proj = Linear(self.c, self.hq * (self.n + self.dv), bias=False)
        self.o_proj = Linear(self.hq * self.dv, H, bias=bias)
        self.scale = mla_scale(cfg)
        self.interleave, self.rope = cfg.rope_interleave, cfg.mla_rope
        self.fused_in: torch.Tensor | None = None  # see fuse_projections
        first = self.q_lora if self.q_lora else q_out
        self.in_sizes = [first, self.c + self.r]

    def fuse_projections(self) -> None:
        """q_a_proj (or q_proj) and kv_a_proj_with_mqa read the same input: one GEMM."""
        first = self.q_a_proj if self.q_lora else self.q_proj
        self.fused_in = fuse_linears([first, self.kv_a_proj_with_mqa])

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.rope:  # kimi_linear: NoPE, the "rope" dims pass unrotated
            return x
        if self.interleave:
            return apply_rotary_interleaved(x, cos, sin)
        return apply_rotary(x, cos, sin)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q_nope [T, Hq, N], q_rope [T, Hq, R] (rotated), latent [T, 1, C+R]."""
        return self._project_all(x, cos, sin)[:3]

    def _project_all(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`_project`'s three, and the q LoRA's normalised output q_resid [T, Q] (None without
        q LoRA): GLM-5's indexer reads it."""
        T = x.shape[0]
        if self.fused_in is not None:
            qa, ckv = split_linear(x, self.fused_in, self.in_sizes)
        else:
            qa = self.q_a_proj(x) if self.q_lora else self.q_proj(x)
            ckv = self.kv_a_proj_with_mqa(x)  # [T, C+R]
        q_resid = self.q_a_layernorm(qa) if self.q_lora else None  # [T, Q]
        q = self.q_b_proj(q_resid) if q_resid is not None else qa  # [T, Hq*(N+R)]
        q = q.view(T, self.hq, self.n + self.r)
        q_nope, q_rope = q[..., :self.n], self._rope(q[..., self.n:], cos, sin)
        c_kv = self.kv_a_layernorm(ckv[:, :self.c])  # [T, C]
        k_rope = self._rope(ckv[:, None, self.c:], cos, sin)  # [T, 1, R]
        return q_nope, q_rope, torch.cat([c_kv[:, None, :], k_rope], dim=-1), q_resid

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [Hq, N, C] and W_UV [Hq, Dv, C]: views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.hq, self.n + self.dv, self.c)
        return w[:, :self.n], w[:, self.n:]

    def absorb_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, Hq, N], q_rope [T, Hq, R] -> q_lat [T, Hq, C+R] = [q_nope·W_UK | q_rope]."""
        w_uk, _ = self._kv_b()
        q_c = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype))  # [Hq, T, C]
        return torch.cat([q_c.transpose(0, 1), q_rope], dim=-1)

    def absorbed_out(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, Hq, C] (attention over the latents) -> [T, Hq, Dv] through W_UV."""
        _, w_uv = self._kv_b()
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2).to(o_lat.dtype))  # [Hq, T, Dv]
        return o.transpose(0, 1)

    def expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain form: latents [L, 1, C+R] -> k [L, Hq, N+R], v [L, Hq, Dv]."""
        L = lat.shape[0]
        kv = self.kv_b_proj(lat[:, 0, :self.c]).view(L, self.hq, self.n + self.dv)
        k_rope = lat[:, :, self.c:].expand(L, self.hq, self.r)  # [L, Hq, R] (shared)
        return torch.cat([kv[..., :self.n], k_rope], dim=-1), kv[..., self.n:]

    def decode_one(self, q_lat: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor
                   ) -> torch.Tensor:
        """One decode row: q_lat [Hq, C+R] over the latents at `slots` [L] -> o_lat [Hq, C]."""
        o = cpu_decode_attention(q_lat, pool, pool, slots, self.scale)  # in place, or None
        if o is None:
            lat = pool[slots]  # [L, 1, C+R]
            o = attend(q_lat[None], lat, lat, slots.numel() - 1, self.scale)[0]
        return o[:, :self.c].to(q_lat.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        T = x.shape[0]
        q_nope, q_rope, latent = self._project(x, cos, sin)
        pool = kv.k[kv.layer_index[self.layer_id]]  # [S, 1, C+R]
        if batch.ctx is not None:  # decode-only step of the runner: absorbed, every row
            attn = batch.ctx.attn
            if attn.name not in ("torch", "triton_mla"):
                raise NotImplementedError(
                    f"MLA decode through the {attn.name!r} attention plan is not built; the "
                    "decode runner must plan 'triton_mla' or 'torch' for MLA models")
            pool.index_copy_(0, batch.ctx.out_slots, latent.to(pool.dtype))
            q_lat = self.absorb_query(q_nope, q_rope)  # [B, Hq, C+R]
            if attn.name == "triton_mla":  # in place over the runner's CSR; capturable
                o_lat = attn.run_latent(q_lat.to(pool.dtype).contiguous(), pool, self.scale,
                                        self.c)  # [B, Hq, C]
            else:
                o_lat = torch.stack([self.decode_one(q_lat[b], pool, s)
                                     for b, s in enumerate(attn.rows)])  # [B, Hq, C]
            return self.o_proj(self.absorbed_out(o_lat).reshape(T, self.hq * self.dv))
        out = torch.empty(T, self.hq, self.dv, dtype=x.dtype, device=x.device)  # [T, Hq, Dv]
        cu = batch.cu
        for b in range(batch.num_seqs):
            lo, hi, p = cu[b], cu[b + 1], batch.prefix_lens[b]
            slots = batch.kv_slots[b]  # [p + n]
            pool[slots[p:]] = latent[lo:hi].to(pool.dtype)
            if hi - lo == 1:  # decode row: absorbed form over the latents
                q_lat = self.absorb_query(q_nope[lo:hi], q_rope[lo:hi])  # [1, Hq, C+R]
                out[lo:hi] = self.absorbed_out(self.decode_one(q_lat[0], pool, slots)[None])
                continue
            k, v = self.expand(pool[slots].to(x.dtype))  # [L, Hq, N+R], [L, Hq, Dv]
            q = torch.cat([q_nope[lo:hi], q_rope[lo:hi]], dim=-1)  # [n, Hq, N+R]
            out[lo:hi] = attend(q, k, v, p, self.scale)
        return self.o_proj(out.reshape(T, self.hq * self.dv))
