"""`fused`: every routed expert of a layer resident on the compute device."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from freetoken.experts.base import ExpertBackend, SharedWeights
from freetoken.experts.ffn import run_experts
from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.quant import QuantBank
from freetoken.types.forward_batch import MoEStep


class FusedExperts(ExpertBackend):
    """All routed experts of one layer on the compute device: gate_up_proj [E, 2I, H] rows
    [gate | up], down_proj [E, H, I] (the checkpoint's parameter names) — parameters, or
    quantized `QuantBank`s held as plain attributes (`hold_banks`: they move with the module's
    device and keep their format whatever dtype the module is cast to)."""

    name = "fused"

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, inter))

    @classmethod
    def from_banks(cls, gate_up: Tensor | QuantBank, down: Tensor | QuantBank) -> FusedExperts:
        """A layer over given banks (held, not copied)."""
        fe = cls(1, 1, 1)
        if isinstance(gate_up, QuantBank):
            fe.hold_banks(gate_up, down)
            return fe
        fe.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        fe.down_proj = nn.Parameter(down, requires_grad=False)
        return fe

    def hold_banks(self, gate_up: QuantBank, down: QuantBank) -> None:
        """Hold quantized banks in place of the two parameters."""
        for name in ("gate_up_proj", "down_proj"):
            self._parameters.pop(name, None)
        self.gate_up_proj, self.down_proj = gate_up, down

    def release_banks(self) -> None:
        """Drop this layer's banks (a benchmark that moved them into an `ExpertStore` keeps
        one copy: the store's); the block is given its backend by `MoERuntime.install`."""
        self.gate_up_proj = self.down_proj = None

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if isinstance(self.gate_up_proj, QuantBank):
            dev = fn(torch.empty(0)).device  # a device move applies; a dtype cast does not
            self.gate_up_proj, self.down_proj = (self.gate_up_proj.to(dev),
                                                 self.down_proj.to(dev))
        return self

    def forward(self, x: Tensor, topk_ids: Tensor, step: MoEStep | None = None,
                shared: SharedWeights = None, act: ExpertAct | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """(y [T, K, H], the shared expert's output [T, H] or None): see `run_experts`."""
        return run_experts(x, topk_ids, self.gate_up_proj, self.down_proj, shared, act)
