"""nn.Linear whose decode-size products on the CPU stream the weight through the C++ kernel
(kernels.cpu.linear_ops); everything else (GPU, prefill, bias, small weights) is nn.Linear's.
Parameter names are nn.Linear's, so checkpoints load unchanged."""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu.linear_ops import small_linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and x.device.type == "cpu":
            return small_linear(x, self.weight)
        return super().forward(x)
