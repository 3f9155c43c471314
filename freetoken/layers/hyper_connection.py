"""Manifold-constrained hyper-connections (DeepSeek-V4; transformers 5.25
`DeepseekV4HyperConnection` / `DeepseekV4HyperHead`): the residual is N = `hc_mult` streams
[T, N, H]. Before a block, one learned projection of the normalised streams gives three weights:
`pre` [T, N] collapses the streams into the block's input, `post` [T, N] spreads the block's
output back over them, and `comb` [T, N, N] mixes the incoming streams, made doubly stochastic
by Sinkhorn-Knopp iterations:

    streams' = post ⊗ block(Σ_j pre_j · streams_j) + combᵀ · streams

The head collapses the streams once more (its own `pre`) before the final norm. Weights and
arithmetic in fp32, as transformers keeps these modules.

Shapes: T tokens, N streams, H hidden.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freetoken.layers.compressed_attention import unit_rmsnorm
from freetoken.layers.fp32 import KeepFp32


class HyperConnection(KeepFp32):
    fp32_params = ("fn", "base", "scale")

    def __init__(self, hidden: int, n: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [T, N, H] -> post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, H]."""
        T, n = streams.shape[0], self.n
        flat = unit_rmsnorm(streams.reshape(T, -1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())  # [T, (2+N)N]
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(T, n, n) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(post: Tensor, comb: Tensor, out: Tensor, streams: Tensor) -> Tensor:
        """post ⊗ out + combᵀ · streams: out [T, H], streams [T, N, H] -> [T, N, H]."""
        dt = streams.dtype
        return (post.to(dt).unsqueeze(-1) * out.unsqueeze(-2)
                + torch.matmul(comb.to(dt).transpose(-1, -2), streams))


class HyperHead(KeepFp32):
    fp32_params = ("hc_fn", "hc_base", "hc_scale")

    def __init__(self, hidden: int, n: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: Tensor) -> Tensor:
        """streams [T, N, H] -> [T, H]."""
        flat = unit_rmsnorm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())  # [T, N]
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
