"""MoE block: softmax router → top-k (→ renormalise), routed experts, optional shared expert.

Routed experts are held as per-layer banks (gate_up [E, 2I, H], rows [gate | up]; down
[E, H, I]) behind an `ExpertBackend` (freetoken/experts/base.py), so the expert runtime can
replace the default all-resident `FusedExperts` without touching the model. Every backend
returns the same thing: per (token, k) UNWEIGHTED expert outputs y [T, K, H]; the block merges
`Σ_k w[t,k]·y[t,k]` itself, in one fixed order, so partial results from different devices merge
exactly. The step's `MoEStep` (how the backends run it) travels with the batch.

Shapes: T tokens, H hidden, E experts, K top-k, I expert intermediate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.experts.base import ExpertBackend
from freetoken.experts.ffn import shared_expert
from freetoken.experts.fused import FusedExperts
from freetoken.layers import fast_ops
from freetoken.layers.linear import Linear, fuse_linears, split_linear
from freetoken.types.forward_batch import EAGER, MoEStep
from freetoken.types.model_config import ModelConfig


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.fused_gu: torch.Tensor | None = None  # see fuse_projections
        self.inter = inter

    def fuse_projections(self) -> None:
        self.fused_gu = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gu is not None:
            g, u = split_linear(x, self.fused_gu, [self.inter, self.inter])
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor, row_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (w [T, K] x.dtype, ids [T, K] int64); ids -1 on rows outside
        `row_mask` [T] bool (they route no expert)."""
        fused = fast_ops.router(x, self.weight, self.top_k, self.renormalize, row_mask)
        if fused is not None:
            return fused
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)  # [T, E] fp32
        w, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        if row_mask is not None:
            ids = ids.masked_fill(~row_mask[:, None], -1)
        return w.to(x.dtype), ids


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        H = cfg.hidden_size
        self.gate = Router(H, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob)
        self.moe_index = cfg.moe_layers.index(layer_id)  # its index among the MoE layers
        self.experts: ExpertBackend = FusedExperts(cfg.num_experts, H,
                                                   cfg.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(H, 1, bias=False)
        self.route_hook = None  # callable(layer_id, topk_ids) for routing traces

    def forward(self, x: torch.Tensor, step: MoEStep | None = None,
                residual: torch.Tensor | None = None, next_norm: nn.Module | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> [T, H] (plus `residual` [T, H] when given, merged in the same pass).
        `step`: how the backend runs this step (None: eager); its `row_mask [T]` bool says
        which rows route (a graph bucket's padding rows do not: their ids become -1, so they
        move no expert and compute none). `next_norm` (the next decoder
        layer's input RMSNorm): return (out, next_norm(out)), the norm in the combine's launch.

        On the CUDA decode path the shared expert runs inside the routed experts' launches
        (`fused`, and the slot backends' GPU share) or in two launches of the same kernels
        (where the experts are not computed on the GPU in one call), and its sigmoid gate
        inside the combine; elsewhere it is the MLP and the gate's Linear."""
        step = step or EAGER
        w, ids = self.gate(x, row_mask=step.row_mask)  # [T, K], [T, K]
        if self.route_hook is not None:
            self.route_hook(self.layer_id, ids)
        sw = self._shared_weights()
        shared = None
        # [T, K, H] unweighted, and the shared expert's [T, H] where it rode the same launches
        y, shared = self.experts(x, ids, step, shared=sw)
        gate_w = None
        if self.shared_expert is not None:
            if shared is None and sw is not None:
                shared = shared_expert(x, *sw)  # [T, H] or None
            if shared is None:
                shared = self.shared_expert(x)  # [T, H]
            gate_w = self.shared_expert_gate.weight  # [1, H]
        if residual is None:
            residual = torch.zeros_like(x)
        return fast_ops.moe_combine(y, w, residual, shared, x, gate_w, next_norm)

    def _shared_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [2I, H], down [H, I]) of the shared expert once its projections are fused
        (`QwenMoE.fuse_projections`), else None."""
        sh = self.shared_expert
        if sh is None or sh.fused_gu is None:
            return None
        return sh.fused_gu, sh.down_proj.weight
