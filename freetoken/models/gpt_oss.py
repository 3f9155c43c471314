"""gpt-oss (`gpt_oss`): sink attention on every layer, alternating sliding-window and full
(freetoken/layers/sink_attention.py), then a MoE block on every layer: a router with a bias
(top-k of its logits, softmax over the k) and routed experts with biases and the clamped SwiGLU
(freetoken/kernels/expert_act.py). The experts' banks are QwenMoE's ([E, 2I, H] rows [gate | up],
[E, H, I]; MXFP4 `QuantBank`s for the released checkpoints) behind the same `ExpertBackend`s;
their biases stay on the block and travel to the backend as a bound `ExpertAct`. The decoder,
its forward and the expert-backend plumbing are QwenMoE's.

Parameter names are the checkpoint's (freetoken/checkpoint/gpt_oss.py), except the experts'
biases: `mlp.gate_up_bias` [E, 2I] (rows [gate | up], regrouped from the interleaved
`experts.gate_up_proj_bias`) and `mlp.down_bias` [E, H].

Shapes: T tokens, H hidden, E experts, K top-k, I expert intermediate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freetoken.experts.fused import FusedExperts
from freetoken.kernels.expert_act import ExpertAct
from freetoken.layers import fast_ops
from freetoken.layers.moe import MoEBlock
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope_scaling import make_rotary
from freetoken.layers.sink_attention import SinkAttention
from freetoken.models.qwen import DecoderLayer, QwenMoE
from freetoken.types.forward_batch import EAGER, MoEStep
from freetoken.types.model_config import ModelConfig


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k = top_k

    def forward(self, x: Tensor, row_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (w [T, K] x.dtype, ids [T, K] int64): the top-k logits' softmax, as
        transformers' GptOssTopKRouter (in the logits' dtype); ids -1 outside `row_mask`."""
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, K]
        w = F.softmax(top, dim=-1, dtype=top.dtype)
        if row_mask is not None:
            ids = ids.masked_fill(~row_mask[:, None], -1)
        return w.to(x.dtype), ids


class GptOssMoE(MoEBlock):
    """See the module docstring; `forward` is MoEBlock's contract (no shared expert)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        nn.Module.__init__(self)
        self.layer_id = layer_id
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = GptOssRouter(H, E, cfg.top_k)
        self.moe_index = cfg.moe_layers.index(layer_id)
        self.experts = FusedExperts(E, H, I)
        self.shared_expert = None
        self.gate_up_bias = nn.Parameter(torch.zeros(E, 2 * I))  # [E, 2I] rows [gate | up]
        self.down_bias = nn.Parameter(torch.zeros(E, H))  # [E, H]
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.route_hook = None

    @property
    def gate(self) -> GptOssRouter:
        """The router under MoEBlock's name (routing traces wrap `block.gate.forward`)."""
        return self.router

    def expert_act(self) -> ExpertAct:
        """The experts' activation and biases (unbound; what the runtime copies to the host)."""
        return ExpertAct(self.alpha, self.limit, self.gate_up_bias, self.down_bias)

    def forward(self, x: Tensor, step: MoEStep | None = None, residual: Tensor | None = None,
                next_norm: nn.Module | None = None) -> Tensor | tuple[Tensor, Tensor]:
        step = step or EAGER
        w, ids = self.router(x, row_mask=step.row_mask)  # [T, K], [T, K]
        if self.route_hook is not None:
            self.route_hook(self.layer_id, ids)
        y, _ = self.experts(x, ids, step, act=self.expert_act().bind(ids))  # [T, K, H]
        if residual is None:
            residual = torch.zeros_like(x)
        return fast_ops.moe_combine(y, w, residual, None, x, None, next_norm)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, i: int):
        nn.Module.__init__(self)
        self.is_linear = False
        self.self_attn = SinkAttention(cfg, i)
        self.is_moe = True
        self.mlp: nn.Module = GptOssMoE(cfg, i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)


class GptOssBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)


class GptOss(QwenMoE):
    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.model = GptOssBackbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # weight only
        self.rotary = make_rotary(cfg.rotary_dim, cfg.rope_theta, dict(cfg.rope_scaling),
                                  cfg.max_position_embeddings)
