"""The contract between a MoE block and whatever computes its routed experts, and what the
expert runtime needs of the model it serves.

Every backend — `fused` (all banks on the compute device, experts/fused.py), `offload`
(experts/offload.py), `cpu` and `hybrid` (experts/split.py), `auto` (experts/auto.py) — is an
`ExpertBackend`, built complete by `experts.registry.create_backend(name, layer, runtime)` and
installed once on every MoE block by `MoERuntime.install` (experts/runtime.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from torch import Tensor, nn

from freetoken.types.forward_batch import MoEStep
from freetoken.types.model_config import ModelConfig

# a block's shared expert: gate_up [2I, H], down [H, I]
SharedWeights = tuple[Tensor, Tensor] | None


class ExpertBackend(nn.Module):
    """Computes one MoE layer's routed experts for a batch of tokens.

    `forward(x, topk_ids, step, shared=None, act=None) -> (y, shared_out)`:
      - `x [T, H]`: the block's normalised input, model dtype, on the compute device.
      - `topk_ids [T, K]` int64: routed expert ids in [0, E); entries < 0 are padding (a graph
        bucket's unused rows) and are ignored: nothing is computed or fetched for them and y is
        0 there.
      - `step`: the step's `MoEStep` (types/forward_batch.py): its `mode` says how the step
        runs (`eager`; `captured`, a decode step of the runner, which a backend runs without a
        host sync where it can, through `step.bridge` for a CPU share; `streamed`, a long
        prefill chunk through the layer streamer).
      - `shared`: the block's shared expert (gate_up [2I, H], down [H, I]) where the backend
        can run it in its own launches.
      - `act`: the experts' activation (freetoken/kernels/expert_act.py): gpt-oss's biases and
        clamped SwiGLU ("oai") or DeepSeek-V4's clamped SwiGLU without biases ("clamp"), bound
        to topk_ids (the biases follow the logical ids, whatever slot computes an entry);
        None: the plain SwiGLU below. With an act the shared expert is the block's to run.
        The CPU branch of a captured step reads the host copy the runtime took at install
        (`MoERuntime.acts`).
      - returns `y [T, K, H]` in x's dtype: the UNWEIGHTED output of expert topk_ids[t, k] on
        x[t] (down · (silu(gate · x) ⊙ up · x)); the block applies the routing weights itself,
        in one fixed order, so partial results computed on different devices merge exactly;
        and the shared expert's output [T, H] when it rode the backend's launches, else None
        (the block runs it).
    Results equal `freetoken.kernels.reference.expert_ffn_reference` (float64) to the dtype's
    rounding; in fp32 on the CPU every backend is bit-identical to `fused`.

    A backend knows its MoE layer's index among the model's MoE blocks (`m`, 0..L-1, the order
    of `MoEHost.moe_blocks()`; not the decoder-layer index: dense layers are skipped): it names
    the bank (host store, residency table rows) the layer reads.
    """

    name = "base"

    def forward(self, x: Tensor, topk_ids: Tensor, step: MoEStep,
                shared: SharedWeights = None, act=None) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    @property
    def device_fill(self) -> bool:
        """Whether a decode step through this layer issues no host sync without a CPU bridge
        (resident banks; offload with device-driven fills)."""
        return True

    def needs_bridge(self, max_entries: int) -> bool:
        """Whether a captured decode step of up to `max_entries` (token, k) pairs can send work
        to the CPU through this layer (the runtime then gives the step a CPU bridge)."""
        return False


class MoEHost(Protocol):
    """What the expert runtime reads of the model it serves (models/qwen.py's QwenMoE): its
    config, its MoE blocks in layer order (each with an `experts` backend the runtime replaces
    once), and its parameters (to size the slot cache beside the rest of the weights)."""

    cfg: ModelConfig

    def moe_blocks(self) -> list: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
