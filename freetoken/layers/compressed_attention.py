"""DeepSeek-V4 attention over the paged KV pool: one shared K=V head with a sliding window, a
learned sink per head, and on CSA / HCA layers compressed entries of the whole context.

Per layer (transformers 5.25 `DeepseekV4Attention`, its compressors and lightning indexer):

- q = rope(unweighted_rmsnorm(q_b(q_a_norm(q_a(x))))) per head; kv = rope(kv_norm(kv_proj(x))),
  one head of D that is both key and value; the rope rotates the trailing R dims of each head
  on interleaved pairs (the main rope on sliding layers, the compress rope on CSA / HCA ones);
- a query at position t reads the window's kv (positions t - W < j <= t) and the compressed
  entries closed by t (entry w covers tokens up to (w + 1)·m - 1, so w < (t + 1) // m); HCA reads
  every such entry, CSA only the `index_topk` its indexer scores best; the sink joins the
  softmax as one more logit; the output's rope slice is rotated back by the query's angle;
- a compressed entry is a softmax-gated sum over its window of per-token projections (gate
  plus a learned per-position bias), normalised and rotated at position w·m: HCA's window is
  its own m' tokens; CSA's is 2m wide (the previous window's first half-projection Ca beside
  this window's second half Cb); the indexer compresses the same way at its own width Di;
- the output: a grouped low-rank projection (`o_groups` groups of heads, each to
  `o_lora_rank`), then `o_b_proj`.

Pool entry of every token (`DSV4Spec.entry_dims`): K = [kv D | compressed D | indexer Di],
V = the raw per-token projections [kv | gate] (CSA: 2D each, then the indexer's 2Di each). A
compressed entry is written at the slot of its window's last token, when the forward that
holds that token runs; the raw projections stay so that a chunk that starts inside a window
(after a cached prefix of any length) can close it. So the radix cache reuses any prefix, as
for plain attention; the cost is the pool's width (not the compressed layout the paper's 1M
context relies on: docs/models.md).

Every path runs in torch (prefill and decode, CPU and CUDA); the decode runner plans "torch"
for this family (per-row slot lists, no CUDA graphs).

Shapes: T packed tokens, Hq heads, D head dim, R rope dims, m compress rate, Di / Hi indexer
head dim / heads, n new tokens of one sequence, L its length, W window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freetoken.cache.tensors import KVPool
from freetoken.layers.fp32 import KeepFp32
from freetoken.layers.linear import Linear
from freetoken.layers.rope_scaling import make_rotary
from freetoken.layers.rotary import Rotary
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ModelConfig

_SCORE_ELEMS = 1 << 26  # bounds a query block's [Hq, rows, keys] fp32 scores to ~256 MB


def rope_tail(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the trailing 2·P dims of x [T, ..., D] on interleaved pairs by cos, sin [T, P]
    (one angle per pair), in fp32, keeping the layout (transformers' V4 `apply_rotary_pos_emb`)."""
    P = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (P,)
    c, s = cos.view(shape).float(), sin.view(shape).float()
    nope, rope = x[..., :-2 * P], x[..., -2 * P:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return torch.cat([nope, rot.to(x.dtype)], dim=-1)


def unit_rmsnorm(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight (transformers' `DeepseekV4UnweightedRMSNorm`)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4RMSNorm(KeepFp32):
    """w · norm(x) in fp32, cast back to x's dtype (`DeepseekV4RMSNorm`; w stays fp32)."""

    fp32_params = ("weight",)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class Compressor(KeepFp32):
    """One compressed series (the attention's, or the indexer's at width Di). `overlap`: CSA's
    two-window form (projections of 2·width), else HCA's (width)."""

    fp32_params = ("position_bias",)

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        out = 2 * width if overlap else width
        self.kv_proj = Linear(hidden, out, bias=False)
        self.gate_proj = Linear(hidden, out, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, out))  # [m, out] fp32
        self.kv_norm = V4RMSNorm(width, eps)
        self.width, self.rate, self.overlap, self.raw = width, rate, overlap, out

    def project(self, x: Tensor) -> Tensor:
        """x [n, H] -> the raw per-token inputs [n, 2·out]: [kv | gate] (what the pool keeps)."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def entries(self, raw: Tensor, base: int, first: int, count: int, cos: Tensor,
                sin: Tensor) -> Tensor:
        """Entries first .. first+count-1 from `raw` [n, 2·out], the raw inputs of positions
        base .. base+n-1 (every token of those windows, and for CSA of the window before the
        first when it exists) -> [count, width], rotated by cos, sin [count, P] (the compress
        rope at positions w·m)."""
        m, d, o = self.rate, self.width, self.raw
        lo = first * m - base
        kv = raw[lo:lo + count * m, :o].reshape(count, m, o)  # [c, m, out]
        gate = raw[lo:lo + count * m, o:].reshape(count, m, o).float() + self.position_bias
        if self.overlap:  # window w: the previous window's Ca (first half) beside its own Cb
            if first > 0:
                pk = raw[lo - m:lo - m + count * m, :o].reshape(count, m, o)
                pg = raw[lo - m:lo - m + count * m, o:].reshape(count, m, o).float()
                prev_kv, prev_g = pk[..., :d], pg[..., :d] + self.position_bias[:, :d]
            else:  # window 0 has none: zero values at -inf (softmax weight 0)
                prev_kv = torch.cat([torch.zeros_like(kv[:1, :, :d]), kv[:-1, :, :d]])
                prev_g = torch.cat([torch.full_like(gate[:1, :, :d], float("-inf")),
                                    gate[:-1, :, :d]])
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)  # [c, 2m, d]
            gate = torch.cat([prev_g, gate[..., d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)  # [c, d]
        return rope_tail(self.kv_norm(pooled), cos, sin)


class Indexer(Compressor):
    """CSA's lightning indexer: its own compressed keys (a CSA compressor of width Di), queries
    from the q LoRA's output, score(t, w) = Σ_h wt_h(t) · relu(q_h(t) · k_w) / √Di; each query
    keeps its best `index_topk` entries."""

    def __init__(self, cfg: ModelConfig, rate: int):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, rate, True, cfg.rms_norm_eps)
        self.hi, self.di, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.q_b_proj = Linear(cfg.q_lora_rank, self.hi * self.di, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Linear(cfg.hidden_size, self.hi, bias=False)

    def pick(self, x: Tensor, q_resid: Tensor, keys: Tensor, visible: Tensor, cos: Tensor,
             sin: Tensor) -> Tensor:
        """x [n, H], q_resid [n, Q], keys [C, Di] (the sequence's entries), visible [n] (how
        many entries each query may read), cos, sin [n, P] -> bool [n, C]: each query's top
        min(index_topk, visible) entries."""
        n, C = x.shape[0], keys.shape[0]
        q = rope_tail(self.q_b_proj(q_resid).view(n, self.hi, self.di), cos, sin)  # [n, Hi, Di]
        s = F.relu(torch.einsum("nhd,cd->nhc", q.float(), keys.float())) * self.di ** -0.5
        wt = self.scorer.weights_proj(x).float() * self.hi ** -0.5  # [n, Hi]
        score = (s * wt[..., None]).sum(1)  # [n, C]
        ok = torch.arange(C, device=x.device)[None, :] < visible[:, None]
        score = score.masked_fill(~ok, float("-inf"))
        top = score.topk(min(self.topk, C), dim=-1).indices  # [n, k]
        keep = torch.zeros(n, C, dtype=torch.bool, device=x.device).scatter_(1, top, True)
        return keep & ok


class V4Ropes:
    """The two ropes (`main`: sliding layers; `compress`: CSA / HCA layers, their compressed
    entries and indexer queries), as one angle per interleaved pair [n, P], fp32."""

    def __init__(self, cfg: ModelConfig):
        spec = cfg.dsv4
        assert spec is not None
        R = cfg.rotary_dim
        self.main = Rotary(R, cfg.rope_theta)
        self.compress = make_rotary(R, spec.compress_theta, dict(spec.compress_scaling),
                                    cfg.max_position_embeddings)
        self.half = R // 2

    def at(self, which: str, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = getattr(self, which).cos_sin(positions, torch.float32)  # [n, R] (cat'd)
        return cos[:, :self.half], sin[:, :self.half]

    def step(self, positions: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        return {k: self.at(k, positions) for k in ("main", "compress")}


class CompressedAttention(KeepFp32):
    fp32_params = ("sinks",)

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        spec = cfg.dsv4
        assert spec is not None
        self.layer_id, self.kind = layer_id, spec.kinds[layer_id]
        H, self.hq, self.d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.q_a_proj = Linear(H, cfg.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.hq * self.d, bias=False)
        self.kv_proj = Linear(H, self.d, bias=False)
        self.kv_norm = V4RMSNorm(self.d, cfg.rms_norm_eps)
        self.groups, self.rank = spec.o_groups, spec.o_lora_rank
        self.o_a_proj = Linear(self.hq * self.d // self.groups, self.groups * self.rank,
                               bias=False)
        self.o_b_proj = Linear(self.groups * self.rank, H, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.hq))
        self.scale = self.d ** -0.5
        self.compressor: nn.Module | None = None
        self.rate = 0
        if self.kind == "hca":
            self.rate = spec.hca_rate
            self.compressor = Compressor(H, self.d, self.rate, False, cfg.rms_norm_eps)
        elif self.kind == "csa":
            self.rate = spec.csa_rate
            self.compressor = Compressor(H, self.d, self.rate, True, cfg.rms_norm_eps)
            # transformers' name: compressor.indexer.*, beside compressor.kv_proj etc.
            self.compressor.indexer = Indexer(cfg, self.rate)
        self.main_rope = self.kind == "sliding"

    # -- the pool entry -------------------------------------------------------------------
    def _raw_cols(self) -> tuple[slice, slice]:
        c = self.compressor
        assert c is not None
        a = 2 * c.raw
        return slice(0, a), slice(a, a + 2 * c.indexer.raw if self.kind == "csa" else a)

    def forward(self, x: Tensor, ropes: V4Ropes, angles: dict[str, tuple[Tensor, Tensor]],
                batch: ForwardBatch, kv: KVPool) -> Tensor:
        """x [T, H] (normalised) -> [T, H]; writes every new token's entry into the pool.
        `angles`: `ropes.step(batch.positions)`, computed once per forward."""
        T = x.shape[0]
        cos, sin = angles["main" if self.main_rope else "compress"]
        q_resid = self.q_a_norm(self.q_a_proj(x))  # [T, Q]
        q = unit_rmsnorm(self.q_b_proj(q_resid).view(T, self.hq, self.d), self.eps)
        q = rope_tail(q, cos, sin)  # [T, Hq, D]
        kvt = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, D]
        li = kv.layer_index[self.layer_id]
        kp, vp = kv.k[li][:, 0], kv.v[li][:, 0]  # [S, Kw], [S, Vw]
        raw = idx_raw = None
        if self.compressor is not None:
            raw = self.compressor.project(x)  # [T, 2·out]
            if self.kind == "csa":
                idx_raw = self.compressor.indexer.project(x)
        if batch.ctx is not None:  # decode-only step of the runner: per-row slot lists
            attn = batch.ctx.attn
            if attn.name != "torch":
                raise NotImplementedError(
                    f"DeepSeek-V4 attention through the {attn.name!r} plan is not built; the "
                    "decode runner plans 'torch' for deepseek_v4")
            seqs = [(slots, slots.numel() - 1, b, b + 1) for b, slots in enumerate(attn.rows)]
        else:
            cu = batch.cu
            seqs = [(batch.kv_slots[b], batch.prefix_lens[b], cu[b], cu[b + 1])
                    for b in range(batch.num_seqs)]
        out = torch.empty(T, self.hq, self.d, dtype=x.dtype, device=x.device)
        pos_all = batch.positions
        for slots, p, lo, hi in seqs:
            new = slots[p:]
            kp[new, :self.d] = kvt[lo:hi].to(kp.dtype)
            if raw is not None:
                rc, ic = self._raw_cols()
                vp[new, rc] = raw[lo:hi].to(vp.dtype)
                if idx_raw is not None:
                    vp[new, ic] = idx_raw[lo:hi].to(vp.dtype)
                self._close_windows(slots, p, kp, vp, ropes)
            out[lo:hi] = self._attend(q[lo:hi], x[lo:hi], q_resid[lo:hi], slots, p, kp,
                                      pos_all[lo:hi], cos[lo:hi], sin[lo:hi])
        o = rope_tail(out, cos, -sin)  # undo the value's rotation at the query's angle
        g = o.reshape(T, self.groups, -1).transpose(0, 1)  # [g, T, Hq·D/g]
        w = self.o_a_proj.weight.view(self.groups, self.rank, -1)  # [g, rank, Hq·D/g]
        grouped = torch.bmm(g, w.transpose(1, 2).to(g.dtype)).transpose(0, 1)  # [T, g, rank]
        return self.o_b_proj(grouped.reshape(T, self.groups * self.rank))

    def _close_windows(self, slots: Tensor, p: int, kp: Tensor, vp: Tensor,
                       ropes: V4Ropes) -> None:
        """Write the entries of every window the new tokens close (its last token in p .. L-1)
        at that token's slot: K[D:2D], and CSA's indexer entry at K[2D:2D+Di]."""
        c, m, L = self.compressor, self.rate, slots.numel()
        first, last = (p + 1 + m - 1) // m - 1, L // m - 1  # windows w with p <= (w+1)m-1 < L
        if last < first:
            return
        count = last - first + 1
        base = max(0, (first - 1) * m) if c.overlap else first * m
        rc, ic = self._raw_cols()
        raw = vp[slots[base:(last + 1) * m]]  # [n', Vw] the windows' raw inputs
        pos = torch.arange(first, last + 1, device=kp.device) * m
        cos, sin = ropes.at("compress", pos)
        ent = c.entries(raw[:, rc], base, first, count, cos, sin)  # [count, D]
        at = slots[(torch.arange(first, last + 1, device=slots.device) + 1) * m - 1]
        kp[at, self.d:2 * self.d] = ent.to(kp.dtype)
        if self.kind == "csa":
            ix = c.indexer.entries(raw[:, ic], base, first, count, cos, sin)  # [count, Di]
            kp[at, 2 * self.d:2 * self.d + ix.shape[1]] = ix.to(kp.dtype)

    def _attend(self, q: Tensor, x: Tensor, q_resid: Tensor, slots: Tensor, p: int, kp: Tensor,
                pos: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """n queries (positions p .. p+n-1) of one sequence -> [n, Hq, D], in blocks of queries
        that each read only their window's keys (so a long chunk costs n·(W + C), not n²)."""
        n, L, W, D = q.shape[0], slots.numel(), self.window, self.d
        ent = ikeys = None
        C = 0
        if self.compressor is not None:
            C = L // self.rate
            ent_slots = slots[self.rate - 1:C * self.rate:self.rate]  # entry w: token (w+1)m-1
            ent = kp[ent_slots, D:2 * D].float()  # [C, D]
            if self.kind == "csa":
                ikeys = kp[ent_slots, 2 * D:2 * D + self.compressor.indexer.di]  # [C, Di]
        heads = max(self.hq, self.compressor.indexer.hi if ikeys is not None else 0)
        rows = 1
        while rows < n and heads * 2 * rows * (W + 2 * rows + C) <= _SCORE_ELEMS:
            rows *= 2
        sink = self.sinks.float()[:, None, None]  # [Hq, 1, 1]
        out = torch.empty_like(q)
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            w0 = max(0, p + i0 - W + 1)  # the block's first readable window key
            keys = kp[slots[w0:p + i1], :D].float()  # [Lw, D] positions w0 .. p+i1-1
            pos_w = torch.arange(w0, p + i1, device=q.device)
            pq = pos[i0:i1, None]
            ok = (pos_w[None, :] <= pq) & (pq - pos_w[None, :] < W)  # [r, Lw]
            if ent is not None:
                visible = torch.div(pos[i0:i1] + 1, self.rate, rounding_mode="floor")  # [r]
                if ikeys is not None and C:
                    pick = self.compressor.indexer.pick(x[i0:i1], q_resid[i0:i1], ikeys,
                                                        visible, cos[i0:i1], sin[i0:i1])
                else:
                    pick = torch.arange(C, device=q.device)[None, :] < visible[:, None]
                keys, ok = torch.cat([keys, ent]), torch.cat([ok, pick], dim=1)
            qh = q[i0:i1].float().transpose(0, 1)  # [Hq, r, D]
            sc = (torch.matmul(qh, keys.t()) * self.scale).masked_fill(~ok, float("-inf"))
            logits = torch.cat([sc, sink.expand(-1, i1 - i0, 1)], dim=-1)
            pr = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
            out[i0:i1] = torch.matmul(pr, keys).transpose(0, 1).to(q.dtype)
        return out
