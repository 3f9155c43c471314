"""An expert FFN's activation and biases when they are not the plain SwiGLU's: gpt-oss's
experts compute, per routed entry (t, k) of logical expert e,

    gu = gate_up[e] · x[t] + gate_up_bias[e]          gu [2I], rows [gate | up]
    g  = min(gate, limit);  u = clamp(up, -limit, limit)
    a  = (u + 1) · g · σ(alpha · g)                    a [I]
    y  = down[e] · a + down_bias[e]                    y [H]

(transformers' `GptOssExperts._apply_gate`, with the checkpoint's interleaved gate/up columns
regrouped into the bank's [gate | up] rows at load). The biases are indexed by the LOGICAL
expert id, `ids` [T, K]: a slot-cache backend computes from slot rows, so the bank row of an
entry and its bias row differ; `bind(ids)` attaches the routed ids once per layer and step, and
every compute path reads the bias of entry (t, k) as `gate_up_bias[ids[t, k]]`.

The biases are small (E · (2I + H) per layer) and stay resident beside the model (on the
compute device for the GPU paths, a host copy for the CPU branch): they never ride the link.
`None` in place of an `ExpertAct` is the plain SwiGLU without biases.

Shapes: T tokens, K top-k, E experts, I expert intermediate, H hidden, n rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class ExpertAct:
    alpha: float
    limit: float
    gate_up_bias: Tensor  # [E, 2I] rows [gate | up]
    down_bias: Tensor  # [E, H]
    ids: Tensor | None = None  # [T, K] logical ids of the step's entries (bind)

    def bind(self, ids: Tensor) -> ExpertAct:
        return replace(self, ids=ids)

    def to(self, device: torch.device | str) -> ExpertAct:
        dev = torch.device(device)
        if self.gate_up_bias.device == dev and (self.ids is None or self.ids.device == dev):
            return self
        return ExpertAct(self.alpha, self.limit, self.gate_up_bias.to(dev),
                         self.down_bias.to(dev), None if self.ids is None else self.ids.to(dev))

    def entry_ids(self) -> Tensor:
        """ids [T*K] flattened (bound ids required)."""
        if self.ids is None:
            raise ValueError("ExpertAct.bind(ids) first: the biases follow the logical ids")
        return self.ids.reshape(-1)


def glu(gu: Tensor, act: ExpertAct | None) -> Tensor:
    """gu [n, 2I] (bias already added) -> the activation [n, I] in gu's dtype."""
    i = gu.shape[-1] // 2
    g, u = gu[..., :i], gu[..., i:]
    if act is None:
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=act.limit)
    u = u.clamp(min=-act.limit, max=act.limit)
    return (u + 1) * (g * torch.sigmoid(g * act.alpha))


def entry_biases(act: ExpertAct | None, entries: Tensor, dtype: torch.dtype
                 ) -> tuple[Tensor | None, Tensor | None]:
    """(gate_up bias [n, 2I], down bias [n, H]) of flat entries `entries` [n] (t * K + k), in
    `dtype`; (None, None) without an act."""
    if act is None:
        return None, None
    e = act.entry_ids().to(entries.device)[entries]  # [n] logical ids
    return act.gate_up_bias[e].to(dtype), act.down_bias[e].to(dtype)


def expert_bias_row(act: ExpertAct | None, entry: int, dtype: torch.dtype
                    ) -> tuple[Tensor | None, Tensor | None]:
    """Both bias rows [2I], [H] of the logical expert of one flat entry (a group's first)."""
    if act is None:
        return None, None
    e = int(act.entry_ids()[entry])
    return act.gate_up_bias[e].to(dtype), act.down_bias[e].to(dtype)
