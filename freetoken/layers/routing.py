"""Group-limited routing (DeepSeek-V3 `noaux_tc`) and its MoE block.

Router: sigmoid scores s = σ(x·Wᵀ) in fp32; the choice uses s + e_score_correction_bias: experts
are split into n_group groups, each group scored by the sum of its two best biased scores, the
topk_group best groups kept and the top-k experts picked inside them. The weights are the
UNBIASED scores of the picked experts, renormalised if norm_topk_prob, times
routed_scaling_factor. Then the block feeds the routed ids to the expert backend exactly as the
softmax `MoEBlock` does, so every backend (fused, offload, cpu, hybrid, auto) runs unchanged,
and adds the ungated shared experts.

Shapes: T tokens, H hidden, E experts, G groups, K top-k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.experts.ffn import shared_expert
from freetoken.layers import fast_ops
from freetoken.layers.fp32 import KeepFp32
from freetoken.layers.moe import MLP, FusedExperts, MoEBlock
from freetoken.types.forward_batch import EAGER, MoEStep
from freetoken.types.model_config import ModelConfig


class GroupLimitedRouter(KeepFp32):
    fp32_params = ("weight", "e_score_correction_bias")  # as transformers keeps them
    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 renormalize: bool, scaling: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling

    def forward(self, x: torch.Tensor, row_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (w [T, K] x.dtype, ids [T, K] int64); ids -1 on rows outside
        `row_mask` [T] bool (they route no expert)."""
        T, E = x.shape[0], self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E] fp32
        choice = scores + self.e_score_correction_bias.float()  # [T, E]
        per_group = choice.view(T, self.n_group, E // self.n_group)  # [T, G, E/G]
        group_scores = per_group.topk(min(2, E // self.n_group), dim=-1)[0].sum(-1)  # [T, G]
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1),
                                    float("-inf"))  # [T, E]
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # [T, K]
        w = scores.gather(1, ids)  # [T, K] fp32
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.scaling
        if row_mask is not None:
            ids = ids.masked_fill(~row_mask[:, None], -1)
        return w.to(x.dtype), ids


class GroupLimitedMoE(MoEBlock):
    """DeepSeek-V3's MoE layer: `GroupLimitedRouter`, routed experts behind an `ExpertBackend`
    (installed by `freetoken.experts.runtime.MoERuntime` like any `MoEBlock`'s), and
    `shared_experts`, a dense MLP of n_shared_experts·I added without a gate."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        nn.Module.__init__(self)  # MoEBlock's softmax router and gated shared expert: not built
        self.layer_id = layer_id
        H = cfg.hidden_size
        self.gate = GroupLimitedRouter(H, cfg.num_experts, cfg.top_k, cfg.n_group,
                                       cfg.topk_group, cfg.norm_topk_prob,
                                       cfg.routed_scaling_factor)
        self.moe_index = cfg.moe_layers.index(layer_id)
        self.experts = FusedExperts(cfg.num_experts, H, cfg.moe_intermediate_size)
        self.shared_experts = MLP(H, cfg.shared_expert_intermediate_size)
        self.shared_expert = None  # MoEBlock's gated one
        self.route_hook = None

    def forward(self, x: torch.Tensor, step: MoEStep | None = None,
                residual: torch.Tensor | None = None, next_norm: nn.Module | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> residual + Σ_k w·y + shared_experts(x) [T, H] (`MoEBlock.forward`'s
        contract: `step` (its row mask), `residual`, `next_norm` alike)."""
        step = step or EAGER
        w, ids = self.gate(x, row_mask=step.row_mask)  # [T, K], [T, K]
        if self.route_hook is not None:
            self.route_hook(self.layer_id, ids)
        sh = self.shared_experts
        sw = (sh.fused_gu, sh.down_proj.weight) if sh.fused_gu is not None else None
        y, shared = self.experts(x, ids, step, shared=sw)  # [T, K, H]
        if shared is None and sw is not None:
            shared = shared_expert(x, *sw)  # [T, H] or None
        if shared is None:
            shared = sh(x)  # [T, H]
        base = shared if residual is None else residual + shared
        return fast_ops.moe_combine(y, w, base, next_norm=next_norm)
