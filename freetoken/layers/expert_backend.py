"""The contract between a MoE block and whatever computes its routed experts.

Every backend — `fused` (all banks on the compute device, freetoken/layers/moe.py) and the slot
cache's `offload`, `cpu`, `hybrid`, `auto` (freetoken/experts/backends.py) — is an
`ExpertBackend`, created by name through `freetoken.experts.registry.create_backend`.
"""
from __future__ import annotations

from torch import Tensor, nn


class ExpertBackend(nn.Module):
    """Computes a MoE layer's routed experts for a batch of tokens.

    `forward(layer, x, topk_ids) -> y`:
      - `layer`: the MoE layer's index among the model's MoE blocks (0..L-1, the order of
        `QwenMoE.moe_blocks()`; not the decoder-layer index: dense layers are skipped). It names
        the bank (host store, residency table rows) the layer reads.
      - `x [T, H]`: the block's normalised input, model dtype, on the compute device.
      - `topk_ids [T, K]` int64: routed expert ids in [0, E); entries < 0 are padding (a graph
        bucket's unused rows) and are ignored: nothing is computed or fetched for them and y is
        0 there.
      - returns `y [T, K, H]` in x's dtype: the UNWEIGHTED output of expert topk_ids[t, k] on
        x[t] (down · (silu(gate · x) ⊙ up · x)); the block applies the routing weights itself,
        in one fixed order, so partial results computed on different devices merge exactly.
    Results equal `kernels.reference.expert_ffn_reference` (float64) to the dtype's rounding; in
    fp32 on the CPU every backend is bit-identical to `fused`.

    `capturable`: a decode step through this backend issues no host sync, so the decode runner
    can capture it in a CUDA graph (offload with device-driven fills; hybrid/cpu through the CPU
    bridge). Backends that are not capturable run the same steps eagerly.
    """

    name = "base"

    @property
    def capturable(self) -> bool:
        return True

    def forward(self, layer: int, x: Tensor, topk_ids: Tensor) -> Tensor:
        raise NotImplementedError

    def forward_with_shared(self, layer: int, x: Tensor, topk_ids: Tensor,
                            shared: tuple[Tensor, Tensor] | None = None
                            ) -> tuple[Tensor, Tensor | None]:
        """`forward`, and the block's shared expert (gate_up [2I, H], down [H, I]) where the
        backend can run it in its own launches: (y [T, K, H], its output [T, H] or None, in
        which case the block runs it)."""
        return self(layer, x, topk_ids), None
