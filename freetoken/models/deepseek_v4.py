"""DeepSeek-V4 (`deepseek_v4`; transformers 5.25 `DeepseekV4ForCausalLM`).

Each decoder layer: hyper-connections around (freetoken/layers/hyper_connection.py) DeepSeek-V4
attention (freetoken/layers/compressed_attention.py: a sliding window plus, per layer kind,
compressed sparse or heavily compressed entries) and a MoE block. The MoE block scores experts
with sqrt(softplus(x·Wᵀ)) (or sigmoid / softmax, per `scoring_func`); the first
`DSV4Spec.hash_layers` take their experts from a fixed token -> experts table (`tid2eid`)
and the rest the top-k of the scores plus a correction bias; the weights are the picked scores,
normalised, times `routed_scaling_factor`. Routed experts (behind an `ExpertBackend`, as every
family's) and the one shared expert compute silu(min(g, limit)) · clamp(u, ±limit).

Parameter names equal transformers' (prefix `model.`).

Shapes: T tokens, N residual streams, H hidden, E experts, K top-k, V vocab, R logits rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freetoken.cache.tensors import Caches
from freetoken.experts.fused import FusedExperts
from freetoken.kernels.cpu.linear_ops import small_linear
from freetoken.kernels.expert_act import ExpertAct
from freetoken.layers import fast_ops
from freetoken.layers.compressed_attention import CompressedAttention, V4RMSNorm, V4Ropes
from freetoken.layers.fp32 import KeepFp32
from freetoken.layers.hyper_connection import HyperConnection, HyperHead
from freetoken.layers.linear import Linear
from freetoken.layers.moe import MoEBlock
from freetoken.models.qwen import QwenMoE
from freetoken.types.forward_batch import EAGER, ForwardBatch, MoEStep
from freetoken.types.model_config import ModelConfig


def _score(logits: Tensor, func: str) -> Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class V4Router(KeepFp32):
    fp32_params = ("e_score_correction_bias",)

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        E, H, K = cfg.num_experts, cfg.hidden_size, cfg.top_k
        self.weight = nn.Parameter(torch.zeros(E, H))
        self.hashed, self.top_k = hashed, K
        self.func, self.scaling = cfg.scoring_func, cfg.routed_scaling_factor
        if hashed:  # (transformers' hash router has no correction bias)
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, K, dtype=torch.long))
            self.fp32_params = ()
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E))

    def forward(self, x: Tensor, input_ids: Tensor, row_mask: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """x [T, H], input_ids [T] -> (w [T, K] x.dtype, ids [T, K] int64, -1 outside
        `row_mask`)."""
        scores = _score(F.linear(x, self.weight), self.func)  # [T, E]
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1,
                             sorted=False).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        if row_mask is not None:
            ids = ids.masked_fill(~row_mask[:, None], -1)
        return w.to(x.dtype), ids


class ClampedMLP(nn.Module):
    """The shared expert: down(silu(min(gate(x), limit)) · clamp(up(x), ±limit))."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x: Tensor) -> Tensor:
        g = self.gate_proj(x).clamp(max=self.limit)
        u = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(g) * u)


class V4MoE(MoEBlock):
    """See the module docstring. `forward` is MoEBlock's contract plus the step's token ids
    (the hash layers route by them)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        nn.Module.__init__(self)
        assert cfg.dsv4 is not None
        self.layer_id = layer_id
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = V4Router(cfg, layer_id in cfg.dsv4.hash_layers)
        self.moe_index = cfg.moe_layers.index(layer_id)
        self.experts = FusedExperts(E, H, I)
        self.shared_experts = ClampedMLP(H, cfg.shared_expert_intermediate_size,
                                         cfg.swiglu_limit)
        self.shared_expert = None  # MoEBlock's gated one
        self.limit = cfg.swiglu_limit
        self.route_hook = None

    def expert_act(self) -> ExpertAct:
        return ExpertAct.clamp(self.limit)

    def forward(self, x: Tensor, step: MoEStep | None = None, residual: Tensor | None = None,
                next_norm: nn.Module | None = None, input_ids: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        step = step or EAGER
        assert input_ids is not None
        w, ids = self.gate(x, input_ids, row_mask=step.row_mask)  # [T, K], [T, K]
        if self.route_hook is not None:
            self.route_hook(self.layer_id, ids)
        y, _ = self.experts(x, ids, step, act=self.expert_act().bind(ids))  # [T, K, H]
        shared = self.shared_experts(x)
        base = shared if residual is None else residual + shared
        return fast_ops.moe_combine(y, w, base, next_norm=next_norm)


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        spec = cfg.dsv4
        assert spec is not None
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = CompressedAttention(cfg, i)
        self.mlp = V4MoE(cfg, i)
        self.input_layernorm = V4RMSNorm(H, eps)
        self.post_attention_layernorm = V4RMSNorm(H, eps)
        self.attn_hc = HyperConnection(H, spec.hc_mult, spec.hc_iters, spec.hc_eps, eps)
        self.ffn_hc = HyperConnection(H, spec.hc_mult, spec.hc_iters, spec.hc_eps, eps)

    def forward(self, x: Tensor, ropes: V4Ropes, angles: dict, batch: ForwardBatch,
                caches: Caches) -> Tensor:
        """x [T, N, H] residual streams -> [T, N, H]."""
        post, comb, h = self.attn_hc(x)
        a = self.self_attn(self.input_layernorm(h), ropes, angles, batch, caches.kv)
        x = HyperConnection.merge(post, comb, a, x)
        post, comb, h = self.ffn_hc(x)
        m = self.mlp(self.post_attention_layernorm(h), batch.moe, input_ids=batch.input_ids)
        return HyperConnection.merge(post, comb, m, x)


class V4Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        spec = cfg.dsv4
        assert spec is not None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, spec.hc_mult, spec.hc_eps, cfg.rms_norm_eps)


class DeepseekV4(QwenMoE):
    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.model = V4Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # weight only
        self.ropes = V4Ropes(cfg)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: Caches) -> Tensor:
        """Runs the packed batch, writes its pool entries, returns logits [R, V] fp32."""
        e = self.model.embed_tokens(batch.input_ids)  # [T, H]
        n = self.cfg.dsv4.hc_mult  # type: ignore[union-attr]
        x = e.unsqueeze(1).expand(-1, n, -1).contiguous()  # [T, N, H]
        angles = self.ropes.step(batch.positions)
        for layer in self.model.layers:
            x = layer(x, self.ropes, angles, batch, caches)
        h = self.model.norm(self.model.hc_head(x[batch.logits_rows]))  # [R, H]
        return small_linear(h, self.output_embedding()).float()  # [R, V]
