"""gpt-oss attention over the paged KV pool: GQA with biases on q/k/v/o, full RoPE (YaRN), a
learned sink logit per head and, on the sliding layers, a window of `W` keys.

The sink joins each query's softmax as one more logit that attends to nothing:
p_j = exp(s_j) / (Σ_i exp(s_i) + exp(sink_h)) (transformers' `eager_attention_forward`), so the
weights over the real keys sum to less than one. A sliding layer's query at position p sees the
keys at positions j with p - W < j <= p (transformers' sliding-window mask). Every layer's K/V
stays in the pool (the radix cache's prefixes hold whole sequences); a sliding layer only reads
the last W of them, so its decode cost does not grow with the context.

Prefill runs in torch on every device, and so does decode on the CPU (the C++ decode kernel
takes neither sinks nor windows yet). The CUDA decode runner plans `triton_sink`
(freetoken/kernels/triton/sink_attention.py: sinks and the window over the step's CSR, capturable
in a CUDA graph; engine/attention_plans.TritonSinkDecode); flashinfer's plan takes no sinks.

Shapes: T packed new tokens, Hq query heads, Hk KV heads, D head_dim, n new tokens of one
sequence, L its keys read, S pool slots.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from freetoken.cache.tensors import KVPool
from freetoken.layers.linear import Linear
from freetoken.layers.rotary import apply_rotary
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ModelConfig

# queries per block of the score matrix: bounds [Hq, rows, L] fp32 to ~256 MB
_SCORE_ELEMS = 1 << 26


def attend_sinks(q: Tensor, k: Tensor, v: Tensor, prefix: int, scale: float, sinks: Tensor,
                 window: int = 0) -> Tensor:
    """n new queries q [n, Hq, D] (positions prefix .. prefix+n-1) over their sequence's keys
    k, v [L, Hk, D] (positions 0 .. L-1, L = prefix + n), causal, with one sink logit per head
    (`sinks` [Hq]) and, when `window` > 0, only keys within the last `window` positions of
    each query. Scores and softmax in fp32; -> [n, Hq, D] in q's dtype."""
    n, Hq, _ = q.shape
    start = max(0, prefix - window + 1) if window else 0  # no query reads a key before it
    k, v = k[start:].float(), v[start:].float()  # [L', Hk, D]
    r = Hq // k.shape[1]
    kh = k.transpose(0, 1).repeat_interleave(r, 0)  # [Hq, L', D]
    vh = v.transpose(0, 1).repeat_interleave(r, 0)  # [Hq, L', D]
    pos_k = torch.arange(start, start + k.shape[0], device=q.device)  # [L']
    sink = sinks.float()[:, None, None]  # [Hq, 1, 1]
    out = torch.empty_like(q)
    rows = max(1, _SCORE_ELEMS // max(1, Hq * k.shape[0]))
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        qh = q[i0:i1].float().transpose(0, 1)  # [Hq, m, D]
        s = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [Hq, m, L']
        pos_q = prefix + torch.arange(i0, i1, device=q.device)[:, None]  # [m, 1]
        ok = pos_k[None, :] <= pos_q  # [m, L']
        if window:
            ok &= pos_q - pos_k[None, :] < window
        s = s.masked_fill(~ok, float("-inf"))
        logits = torch.cat([s, sink.expand(-1, i1 - i0, 1)], dim=-1)  # [Hq, m, L'+1]
        p = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
        out[i0:i1] = torch.matmul(p, vh).transpose(0, 1).to(q.dtype)  # [m, Hq, D]
    return out


class SinkAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.hq, self.hk, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = Linear(H, self.hq * self.d, bias=bias)
        self.k_proj = Linear(H, self.hk * self.d, bias=bias)
        self.v_proj = Linear(H, self.hk * self.d, bias=bias)
        self.o_proj = Linear(self.hq * self.d, H, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.hq))  # [Hq]
        self.window = cfg.sliding_window if layer_id in cfg.sliding_layers else 0
        self.scale = self.d ** -0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch,
                kv: KVPool) -> Tensor:
        T = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(T, self.hq, self.d), cos, sin)  # [T, Hq, D]
        k = apply_rotary(self.k_proj(x).view(T, self.hk, self.d), cos, sin)  # [T, Hk, D]
        v = self.v_proj(x).view(T, self.hk, self.d)  # [T, Hk, D]
        li = kv.layer_index[self.layer_id]
        k_pool, v_pool = kv.k[li], kv.v[li]  # [S, Hk, D]
        out = torch.empty(T, self.hq, self.d, dtype=x.dtype, device=x.device)  # [T, Hq, D]
        if batch.ctx is not None:  # decode-only step of the runner
            attn = batch.ctx.attn
            if attn.name not in ("torch", "triton_sink"):
                raise NotImplementedError(
                    f"sink attention through the {attn.name!r} plan is not built; the decode "
                    "runner plans 'triton_sink' (CUDA) or 'torch' for gpt_oss")
            k_pool.index_copy_(0, batch.ctx.out_slots, k.to(k_pool.dtype))
            v_pool.index_copy_(0, batch.ctx.out_slots, v.to(v_pool.dtype))
            if attn.name == "triton_sink":  # the step's CSR, in one launch (capturable)
                out = attn.run_sinks(q, k_pool, v_pool, self.scale, self.sinks, self.window)
                return self.o_proj(out.reshape(T, self.hq * self.d))
            for b, slots in enumerate(attn.rows):  # per-row slot lists
                out[b:b + 1] = self._attend(q[b:b + 1], k_pool, v_pool, slots)
            return self.o_proj(out.reshape(T, self.hq * self.d))
        cu = batch.cu
        for b in range(batch.num_seqs):
            lo, hi, p = cu[b], cu[b + 1], batch.prefix_lens[b]
            slots = batch.kv_slots[b]  # [p + n]
            k_pool[slots[p:]] = k[lo:hi].to(k_pool.dtype)
            v_pool[slots[p:]] = v[lo:hi].to(v_pool.dtype)
            out[lo:hi] = self._attend(q[lo:hi], k_pool, v_pool, slots)
        return self.o_proj(out.reshape(T, self.hq * self.d))

    def _attend(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, slots: Tensor) -> Tensor:
        """q [n, Hq, D], the last n of the sequence's `slots` [L] -> [n, Hq, D]; a sliding
        layer gathers only the keys its queries can see."""
        n, L = q.shape[0], slots.numel()
        p = L - n
        lo = max(0, p - self.window + 1) if self.window else 0
        s = slots[lo:]  # the readable keys, positions lo .. L-1 (the window is relative)
        return attend_sinks(q, k_pool[s], v_pool[s], p - lo, self.scale, self.sinks,
                            self.window)
