"""MoE block: softmax router → top-k (→ renormalise), routed experts, optional shared expert.

Routed experts are held as per-layer banks (gate_up [E, 2I, H], rows [gate | up]; down
[E, H, I]) behind an `ExpertBackend`, so the expert store / slot cache can replace the default
all-resident `FusedExperts` without touching the model. Every backend returns the same thing:
per (token, k) UNWEIGHTED expert outputs y [T, K, H]; the block merges `Σ_k w[t,k]·y[t,k]`
itself, in one fixed order, so partial results from different devices merge exactly.

Shapes: T tokens, H hidden, E experts, K top-k, I expert intermediate, U unique experts hit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.layers import fast_ops
from freetoken.layers.expert_backend import ExpertBackend
from freetoken.layers.linear import Linear, fuse_linears, split_linear
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


def expert_group_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                         ) -> torch.Tensor:
    """One expert on the tokens routed to it. x [n, H]; gate_up [2I, H]; down [H, I] -> [n, H]."""
    gu = F.linear(x, gate_up)  # [n, 2I]
    i = gu.shape[-1] // 2
    return F.linear(F.silu(gu[:, :i]) * gu[:, i:], down)  # [n, H]


# On CUDA, batches of at most this many (token, k) entries take the gathered path: a fixed
# handful of kernels and no host sync, instead of ~10 launches per distinct expert.
GATHER_MAX_ENTRIES = 64


def gathered_experts(x: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Decode-sized batches: gather each entry's expert weights and run two batched GEMVs.
    Entries outside `mask` (or with id < 0) keep y's value. N = T*K entries."""
    T, K = topk_ids.shape
    keep = topk_ids >= 0 if mask is None else mask & (topk_ids >= 0)  # [T, K]
    flat = topk_ids.clamp(min=0).reshape(-1)  # [N]
    xs = x.repeat_interleave(K, dim=0)[:, :, None]  # [N, H, 1]
    gu = torch.bmm(gate_up[flat], xs)[..., 0]  # [N, 2I]
    i = gu.shape[-1] // 2
    a = (F.silu(gu[:, :i]) * gu[:, i:])[:, :, None]  # [N, I, 1]
    o = torch.bmm(down[flat], a)[..., 0].view(T, K, -1)  # [T, K, H]
    y.copy_(torch.where(keep[..., None], o.to(y.dtype), y))
    return y


def dispatch_experts(x: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None,
                    bank_index: torch.Tensor | None = None, num_threads: int | None = None
                    ) -> torch.Tensor:
    """Fill y [T, K, H] for the (t, k) entries selected by `mask` [T, K] (all if None), reading
    each expert's weights once for all its tokens. `bank_index` maps a logical expert id to its
    row in gate_up/down (slot ids for a slot cache); identity if None. `num_threads`: the C++
    kernel's threads for a decode row on the CPU (None: torch's thread count)."""
    if (x.is_cuda and bank_index is None and topk_ids.numel() <= GATHER_MAX_ENTRIES):
        return gathered_experts(x, topk_ids, gate_up, down, y, mask)
    if x.device.type == "cpu" and x.shape[0] == 1 and bank_index is None:
        # One decode row on the CPU: one call of the C++ expert kernel instead of ~25 torch ops
        # per layer. Every backend computes its CPU-side decode rows here (fused, slot hits on
        # a CPU cache, the CPU branch), each expert of a row by the same dot products, so the
        # backends stay bit-identical to each other in fp32.
        from kernels.cpu.expert_ops import cpu_experts

        keep = topk_ids >= 0 if mask is None else mask & (topk_ids >= 0)  # [1, K]
        o = cpu_experts(x, topk_ids.clamp(min=0), gate_up, down, compute_mask=keep,
                        num_threads=num_threads)  # [1, K, H]
        y[keep] = o[keep].to(y.dtype)
        return y
    flat = topk_ids.reshape(-1)  # [T*K]
    valid = flat >= 0 if mask is None else mask.reshape(-1) & (flat >= 0)  # ids < 0: no expert
    sel = torch.arange(flat.numel(), device=flat.device)[valid]
    if sel.numel() == 0:
        return y
    order = sel[torch.argsort(flat[sel], stable=True)]  # entries grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)  # [U], [U]
    K = topk_ids.shape[1]
    y2 = y.view(-1, y.shape[-1])  # [T*K, H]
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        ent = order[start:start + c]  # [c] flat (t, k) entries routed to e
        start += c
        row = e if bank_index is None else int(bank_index[e])
        y2[ent] = expert_group_forward(x[ent // K], gate_up[row], down[row]).to(y.dtype)
    return y


class FusedExperts(ExpertBackend):
    """All routed experts resident on the compute device (the `fused` backend)."""

    name = "fused"

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, inter))

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.run(x, topk_ids)[0]

    def run(self, x: torch.Tensor, topk_ids: torch.Tensor,
            shared: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y [T, K, H] as `forward`, the shared expert's output [T, H] or None): see
        `run_experts`."""
        return run_experts(x, topk_ids, self.gate_up_proj, self.down_proj, shared)

    def forward_with_shared(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                            shared: tuple[torch.Tensor, torch.Tensor] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.run(x, topk_ids, shared)


def run_experts(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The routed experts of a bank (`fused`'s experts, or a slot cache's slots through slot
    ids): y [T, K, H] unweighted, zeros where ids < 0 (entries routed elsewhere, padding).
    `shared` = (gate_up [2I, H], down [H, I]) of the block's shared expert: the Triton decode
    path runs it in the routed experts' two launches when its I matches and returns its output
    [T, H]; otherwise the second value is None and the caller runs it."""
    T, K = ids.shape
    H = x.shape[-1]
    mod = fast_ops.triton_for(x, "fused_moe")
    if mod is None:
        y = torch.zeros(T, K, H, dtype=x.dtype, device=x.device)  # [T, K, H]
        if fast_ops.fused_moe(x, ids, gate_up, down, y) is None:
            dispatch_experts(x, ids, gate_up, down, y)
        return y, None
    y = torch.empty(T, K, H, dtype=x.dtype, device=x.device)  # [T, K, H], every entry set
    if (shared is not None and ids.numel() <= mod.DECODE_MAX_ENTRIES
            and shared[0].shape[0] == gate_up.shape[1]):
        ys = torch.empty(T, H, dtype=x.dtype, device=x.device)  # [T, H]
        mod.fused_moe_decode(x, ids, gate_up, down, y, zero_missing=True, shared=(*shared, ys))
        return y, ys
    return mod.fused_moe(x, ids, gate_up, down, y, zero_missing=True), None


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
        self.moe_index = cfg.moe_layers.index(layer_id)  # the `layer` of the expert backend
        self.experts: ExpertBackend = FusedExperts(cfg.num_experts, H,
                                                   cfg.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(H, 1, bias=False)
        self.route_hook = None  # callable(layer_id, topk_ids) for routing traces

    def forward(self, x: torch.Tensor, row_mask: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, next_norm: nn.Module | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> [T, H] (plus `residual` [T, H] when given, merged in the same pass).
        `row_mask [T]` bool: rows that route (a graph bucket's padding rows do not: their ids
        become -1, so they move no expert and compute none). `next_norm` (the next decoder
        layer's input RMSNorm): return (out, next_norm(out)), the norm in the combine's launch.

        On the CUDA decode path the shared expert runs inside the routed experts' launches
        (`fused`, and the slot backends' GPU share) or in two launches of the same kernels
        (where the experts are not computed on the GPU in one call), and its sigmoid gate
        inside the combine; elsewhere it is the MLP and the gate's Linear."""
        w, ids = self.gate(x, row_mask=row_mask)  # [T, K], [T, K]
        if self.route_hook is not None:
            self.route_hook(self.layer_id, ids)
        sw = self._shared_weights()
        shared = None
        # [T, K, H] unweighted, and the shared expert's [T, H] where it rode the same launches
        y, shared = self.experts.forward_with_shared(self.moe_index, x, ids, sw)
        gate_w = None
        if self.shared_expert is not None:
            if shared is None and sw is not None:
                shared = fast_ops.shared_expert(x, *sw)  # [T, H] or None
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
