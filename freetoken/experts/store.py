"""Host expert pool: every routed expert of every MoE layer in the runtime bank layout — the
source of truth. Banks are built in their final layout first and pinned afterwards (pinning an
empty buffer and overwriting it would double peak memory and page-fault twice). Banks are dense
tensors or `QuantBank`s (FP8 block-scaled, MXFP4: freetoken/kernels/quant.py), which stay quantized
here, over the link and in the slots; `fmt` says which, and every byte count uses the real bytes."""
from __future__ import annotations

import torch
from torch import Tensor

from freetoken.kernels.quant import QuantBank
from freetoken.log import get_logger, kv
from freetoken.types.model_config import ExpertFormat, expert_nbytes

log = get_logger("experts")


class ExpertStore:
    """Banks indexed by MoE-layer index m (0..L-1, the order of `model.moe_blocks()`).
    gate_up(m) [E, 2I, H]; down(m) [E, H, I] (logical shapes; a QuantBank's own layout).
    `dtype` is the dense banks' dtype, or for quantized banks `compute_dtype` (the activations'
    dtype, float32 unless given)."""

    def __init__(self, gate_up: list[Tensor | QuantBank], down: list[Tensor | QuantBank],
                 pin: bool | None = None, compute_dtype: torch.dtype = torch.float32):
        if pin is None:
            pin = torch.cuda.is_available()
        self._gate_up = [g.detach().cpu().contiguous() for g in gate_up]
        self._down = [d.detach().cpu().contiguous() for d in down]
        if pin:
            self._gate_up = [g.pin_memory() for g in self._gate_up]
            self._down = [d.pin_memory() for d in self._down]
        self.pinned = pin
        g0 = self._gate_up[0]
        self.num_layers, self.num_experts = len(self._gate_up), g0.shape[0]
        self.intermediate, self.hidden = g0.shape[1] // 2, g0.shape[2]
        quant = isinstance(g0, QuantBank)
        kinds = {(b.fmt, b.block) if isinstance(b, QuantBank) else "dense"
                 for b in self._gate_up + self._down}
        if len(kinds) != 1:
            raise ValueError("every bank of an expert store has one format")
        self.fmt: ExpertFormat | None = ExpertFormat(g0.fmt, g0.block) if quant else None
        self.dtype = compute_dtype if quant else g0.dtype
        log.info(kv("store", layers=self.num_layers, experts=self.num_experts,
                    gb=f"{self.nbytes / 1e9:.2f}", pinned=pin, dtype=str(self.dtype)[6:],
                    fmt=self.fmt.name if self.fmt else "dense"))

    @property
    def format(self) -> ExpertFormat | torch.dtype:
        """The banks' storage format (`ExpertFormat`), or the dense dtype."""
        return self.fmt or self.dtype

    def gate_up(self, layer: int) -> Tensor:
        return self._gate_up[layer]

    def down(self, layer: int) -> Tensor:
        return self._down[layer]

    @property
    def expert_bytes(self) -> int:
        return expert_nbytes(self.hidden, self.intermediate, self.format)

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.num_layers * self.num_experts
