"""DeepSeek sparse attention (GLM-5, `glm_moe_dsa`): multi-head latent attention whose queries
each attend over the `index_topk` earlier tokens an indexer picks, not over the whole context.

The indexer of a "full" layer scores every (query, key) pair cheaply: its own query heads
q_i = wq_b(q_resid) [Hi, Di] (q_resid: the attention's q LoRA output), one shared key per token
k = LayerNorm(wk(x)) [Di] (the first R dims of both rotated on interleaved pairs, as the
attention's rope), and per-head weights w = weights_proj(x)·Hi^-0.5 (float32):

    score(t, j) = Σ_h w_h(t) · relu(q_h(t) · k(j) · Di^-0.5)

Each query keeps the top `index_topk` of its causal keys (all of them when the context is that
short or shorter: the sparse and dense forms are then the same). A "shared" layer reuses the
previous full layer's choice (`TopkShare`, written by the full layer earlier in the same forward
pass), as transformers' `prev_topk_indices`.

The pool: each token's indexer key sits beside its latent, as the "V" part of the MLA pool entry
(`ModelConfig.kv_entry`: [S, 1, Di]), so the radix cache, the allocator and every slot copy carry
it with no change. Prefill chunks run the plain form with a [n, L] mask (causal and selected);
decode rows the absorbed form over the selected latent slots only (freetoken/layers/mla.py).

Shapes: T packed new tokens, n of one sequence, L its context, Hi / Di indexer heads and head
dim, R rope dims, Hq heads, S pool slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freetoken.cache.tensors import KVPool
from freetoken.layers.fp32 import KeepFp32
from freetoken.layers.linear import Linear
from freetoken.layers.mla import MLAttention
from freetoken.layers.rope_scaling import apply_rotary_interleaved
from freetoken.layers.step_context import attend
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ModelConfig


class TopkShare:
    """The last full layer's choice in this forward pass, per sequence (prefill: a [n, L] bool
    mask; decode row: the selected slots [k]; None: every causal key), or for the decode
    runner's device step the picked CSR (`csr`: indptr, indices)."""

    def __init__(self) -> None:
        self.picks: list[Tensor | None] = []
        self.csr: tuple[Tensor, Tensor] | None = None


class Fp32Linear(KeepFp32):
    """A bias-free linear kept in float32 in a bf16 model (transformers keeps
    `indexer.weights_proj` so): x is widened, the result is float32."""

    fp32_params = ("weight",)

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_out, d_in))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hi, self.di, self.r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.hi * self.di, bias=False)
        self.wk = Linear(cfg.hidden_size, self.di, bias=False)
        self.k_norm = nn.LayerNorm(self.di, eps=1e-6)
        self.weights_proj = Fp32Linear(cfg.hidden_size, self.hi)
        self.scale = self.di ** -0.5

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [T, heads, Di]: the first R dims rotated (interleaved pairs), the rest passed."""
        return torch.cat([apply_rotary_interleaved(x[..., :self.r], cos, sin), x[..., self.r:]],
                         dim=-1)

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [T, H] -> the tokens' indexer keys [T, Di] (what the pool keeps)."""
        return self._rope(self.k_norm(self.wk(x))[:, None], cos, sin)[:, 0]

    def queries(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor
                ) -> tuple[Tensor, Tensor]:
        """-> q [T, Hi, Di] (rotated), w [T, Hi] float32 (the per-head weights, Hi^-0.5 in)."""
        q = self.wq_b(q_resid).view(-1, self.hi, self.di)
        return self._rope(q, cos, sin), self.weights_proj(x) * self.hi ** -0.5

    def scores(self, q: Tensor, w: Tensor, k: Tensor) -> Tensor:
        """q [n, Hi, Di], w [n, Hi], keys k [L, Di] -> index scores [n, L] float32."""
        s = torch.einsum("nhd,ld->nhl", q.float(), k.float()) * self.scale  # [n, Hi, L]
        return torch.einsum("nh,nhl->nl", w, F.relu(s))

    def scores_rows(self, q: Tensor, w: Tensor, k: Tensor) -> Tensor:
        """B rows' queries q [B, Hi, Di], w [B, Hi] against keys k [N, Di] -> [B, N] float32."""
        s = torch.einsum("bhd,nd->bhn", q.float(), k.float()) * self.scale  # [B, Hi, N]
        return torch.einsum("bh,bhn->bn", w, F.relu(s))

    def pick_mask(self, q: Tensor, w: Tensor, k: Tensor, prefix: int) -> Tensor | None:
        """A chunk's choice: n queries after `prefix` cached tokens over k [L = prefix + n, Di]
        -> [n, L] bool (selected and causal), or None when L <= topk (every causal key)."""
        n, L = q.shape[0], k.shape[0]
        if L <= self.topk:
            return None
        causal = (torch.arange(L, device=k.device)[None, :]
                  <= prefix + torch.arange(n, device=k.device)[:, None])  # [n, L]
        picked = torch.zeros_like(causal)
        # query blocks: the [rows, Hi, L] products stay near 256 MB (a 4k chunk at a 100k
        # context would be 52 GB at once)
        rows = max(1, (64 << 20) // (self.hi * L))
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            s = self.scores(q[lo:hi], w[lo:hi], k).masked_fill(~causal[lo:hi], float("-inf"))
            picked[lo:hi].scatter_(1, s.topk(self.topk, dim=-1).indices, True)
        return picked & causal

    def pick_slots(self, q: Tensor, w: Tensor, k: Tensor, slots: Tensor) -> Tensor:
        """One decode row (q [1, Hi, Di]) over its context's keys k [L, Di] at `slots` [L] ->
        the slots it attends over [min(L, topk)], in position order."""
        if slots.numel() <= self.topk:
            return slots
        idx = self.scores(q, w, k)[0].topk(self.topk).indices.sort().values
        return slots[idx]


def pick_csr(ix: Indexer, q: Tensor, w: Tensor, ipool: Tensor, indptr: Tensor,
             indices: Tensor) -> tuple[Tensor, Tensor]:
    """The decode runner's step on the device: rows' indexer queries q [B, Hi, Di], w [B, Hi]
    over every entry of the step's CSR (indptr [B+1], indices [cap] pool slots) -> the picked
    CSR (indptr [B+1], indices [B·K] int32, K = min(topk, cap)): row b keeps its top
    min(L_b, topk) slots, by score. Every shape is static (B, cap, K) and nothing is read back,
    so the step stays capturable; the cost scales with the CSR's capacity, not the contexts."""
    B, cap = q.shape[0], indices.shape[0]
    dev = q.device
    start, ends = indptr[:-1].long(), indptr[1:].long()  # [B]
    row = torch.searchsorted(ends, torch.arange(cap, device=dev), right=True)  # [cap]; B: none
    slots = indices.long().clamp(0, ipool.shape[0] - 1)  # entries past indptr[B] may be stale
    sc = ix.scores_rows(q, w, ipool[slots, 0])  # [B, cap]
    sc = sc.masked_fill(row[None, :] != torch.arange(B, device=dev)[:, None], float("-inf"))
    K = min(ix.topk, cap)
    top = sc.topk(K, dim=-1).indices  # [B, K]: the row's own entries first (finite scores)
    lens = (ends - start).clamp(max=K)  # [B]
    ptr = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    ptr[1:] = lens.cumsum(0)
    j = torch.arange(B * K, device=dev)
    r = torch.searchsorted(ptr[1:], j, right=True).clamp(max=B - 1)  # [B·K] output row
    src = top[r, (j - ptr[r]).clamp(0, K - 1)]  # [B·K] entry positions (past ptr[B]: unused)
    return ptr.to(indptr.dtype), indices[src].to(torch.int32)


def _masked_attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q [n, Hq, D], k [L, Hq, D], v [L, Hq, Dv], mask [n, L] bool -> [n, Hq, Dv]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


class SparseMLAttention(MLAttention):
    """GLM-5's attention: `MLAttention` with an `Indexer` on "full" layers and the previous
    full layer's choice (`share`) on "shared" ones."""

    def __init__(self, cfg: ModelConfig, layer_id: int, share: TopkShare):
        super().__init__(cfg, layer_id)
        full = cfg.indexer_types[layer_id] == "full"
        self.indexer = Indexer(cfg) if full else None
        self._share = share  # a plain object: no parameters, not a submodule

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
                kv: KVPool) -> Tensor:
        T = x.shape[0]
        q_nope, q_rope, latent, q_resid = self._project_all(x, cos, sin)
        li = kv.layer_index[self.layer_id]
        pool, ipool = kv.k[li], kv.v[li]  # [S, 1, C+R], [S, 1, Di]
        ix = self.indexer
        if ix is not None:
            assert q_resid is not None
            ikey = ix.keys(x, cos, sin).to(ipool.dtype)  # [T, Di]
            iq, iw = ix.queries(x, q_resid, cos, sin)  # [T, Hi, Di], [T, Hi]
        if batch.ctx is not None:  # the decode runner's step: absorbed, every row
            attn = batch.ctx.attn
            if attn.name not in ("torch", "triton_mla"):
                raise NotImplementedError(
                    f"sparse MLA decode through the {attn.name!r} attention plan is not built")
            pool.index_copy_(0, batch.ctx.out_slots, latent.to(pool.dtype))
            if ix is not None:
                ipool.index_copy_(0, batch.ctx.out_slots, ikey[:, None])
            q_lat = self.absorb_query(q_nope, q_rope)  # [B, Hq, C+R]
            if attn.name == "triton_mla":  # picked on the device, the kernel over the pick
                if ix is not None:
                    self._share.csr = pick_csr(ix, iq, iw, ipool, attn.indptr, attn.indices)
                assert self._share.csr is not None
                o_lat = attn.run_latent(q_lat.to(pool.dtype).contiguous(), pool, self.scale,
                                        self.c, csr=self._share.csr)  # [B, Hq, C]
            else:
                if ix is not None:
                    self._share.picks = [
                        ix.pick_slots(iq[b:b + 1], iw[b:b + 1], ipool[s, 0], s)
                        for b, s in enumerate(attn.rows)]
                o_lat = torch.stack([self.decode_one(q_lat[b], pool, s)
                                     for b, s in enumerate(self._share.picks)])  # [B, Hq, C]
            return self.o_proj(self.absorbed_out(o_lat).reshape(T, self.hq * self.dv))
        out = torch.empty(T, self.hq, self.dv, dtype=x.dtype, device=x.device)  # [T, Hq, Dv]
        cu = batch.cu
        picks: list[Tensor | None] = []
        for b in range(batch.num_seqs):
            lo, hi, p = cu[b], cu[b + 1], batch.prefix_lens[b]
            slots = batch.kv_slots[b]  # [p + n]
            pool[slots[p:]] = latent[lo:hi].to(pool.dtype)
            if ix is not None:
                ipool[slots[p:], 0] = ikey[lo:hi]
                keys = ipool[slots, 0]  # [L, Di]
                if hi - lo == 1:
                    picks.append(ix.pick_slots(iq[lo:hi], iw[lo:hi], keys, slots))
                else:
                    picks.append(ix.pick_mask(iq[lo:hi], iw[lo:hi], keys, p))
            pick = picks[b] if ix is not None else self._share.picks[b]
            if hi - lo == 1:  # decode row: absorbed form over the selected latents
                q_lat = self.absorb_query(q_nope[lo:hi], q_rope[lo:hi])  # [1, Hq, C+R]
                sel = slots if pick is None else pick
                out[lo:hi] = self.absorbed_out(self.decode_one(q_lat[0], pool, sel)[None])
                continue
            k, v = self.expand(pool[slots].to(x.dtype))  # [L, Hq, N+R], [L, Hq, Dv]
            q = torch.cat([q_nope[lo:hi], q_rope[lo:hi]], dim=-1)  # [n, Hq, N+R]
            if pick is None:
                out[lo:hi] = attend(q, k, v, p, self.scale)
            else:
                out[lo:hi] = _masked_attend(q, k, v, pick, self.scale)
        if ix is not None:
            self._share.picks = picks
        return self.o_proj(out.reshape(T, self.hq * self.dv))
