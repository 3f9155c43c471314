"""nn.Linear whose decode-size products on the CPU stream the weight through the C++ kernel
(freetoken.kernels.cpu.linear_ops); everything else (GPU, prefill, bias, small weights) is
nn.Linear's. Parameter names are nn.Linear's, so checkpoints load unchanged."""
from __future__ import annotations

import torch
from torch import nn

from freetoken.kernels.cpu.linear_ops import small_linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and x.device.type == "cpu":
            return small_linear(x, self.weight)
        return super().forward(x)


def fuse_linears(linears: list[Linear]) -> torch.Tensor | None:
    """Concatenate the weights of `linears` (same input, no bias, same dtype and device) into one
    [ΣN, K] tensor and make each layer's weight a view of its rows: one GEMM (one launch) then
    serves all of them through `split_linear`, with no extra memory. None when they differ."""
    ws = [m.weight for m in linears]
    if any(m.bias is not None for m in linears) or len({(w.dtype, w.device, w.shape[1])
                                                        for w in ws}) != 1:
        return None
    fused = torch.cat([w.detach() for w in ws], 0)  # [ΣN, K]
    start = 0
    for m, w in zip(linears, ws):
        n = w.shape[0]
        m.weight = nn.Parameter(fused[start:start + n], requires_grad=False)
        start += n
    return fused


def split_linear(x: torch.Tensor, fused: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """F.linear(x, fused) split into the fused layers' outputs."""
    return list(small_linear(x, fused).split(sizes, dim=-1))
