"""An expert FFN's activation and biases when they are not the plain SwiGLU's. Two kinds, per
routed entry (t, k) of logical expert e, gu = gate_up[e] · x[t] (rows [gate | up]):

"oai" (gpt-oss, transformers' `GptOssExperts._apply_gate`; biases required):

    gu = gu + gate_up_bias[e]                         gu [2I]
    g  = min(gate, limit);  u = clamp(up, -limit, limit)
    a  = (u + 1) · g · σ(alpha · g)                    a [I]
    y  = down[e] · a + down_bias[e]                    y [H]

"clamp" (DeepSeek-V4, transformers' `DeepseekV4Experts._apply_gate`; no biases: none are
stored, read or added, and `alpha` is unused):

    a  = silu(min(gate, limit)) · clamp(up, -limit, limit);   y = down[e] · a

gpt-oss's checkpoint interleaves gate/up columns; they are regrouped into the bank's
[gate | up] rows at load. The biases are indexed by the LOGICAL expert id, `ids` [T, K]: a
slot-cache backend computes from slot rows, so the bank row of an entry and its bias row differ;
`bind(ids)` attaches the routed ids once per layer and step, and every compute path reads the
bias of entry (t, k) as `gate_up_bias[ids[t, k]]` ("clamp" needs no ids; binding is harmless).

The biases are small (E · (2I + H) per layer) and stay resident beside the model (on the
compute device for the GPU paths, a host copy for the CPU branch): they never ride the link.
`None` in place of an `ExpertAct` is the plain SwiGLU without biases. The kernels select the
activation by `act_code`: 0 plain (None), 1 "oai", 2 "clamp".

Shapes: T tokens, K top-k, E experts, I expert intermediate, H hidden, n rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

KINDS = ("oai", "clamp")
ACT_CODES = {"oai": 1, "clamp": 2}  # the kernels' activation codes (0: the plain SwiGLU)


@dataclass(frozen=True)
class ExpertAct:
    alpha: float  # "oai" only
    limit: float
    gate_up_bias: Tensor | None  # [E, 2I] rows [gate | up] ("oai"); None ("clamp")
    down_bias: Tensor | None  # [E, H] ("oai"); None ("clamp")
    ids: Tensor | None = None  # [T, K] logical ids of the step's entries (bind)
    kind: str = "oai"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ExpertAct kind {self.kind!r}: one of {KINDS}")
        biased = (self.gate_up_bias is not None, self.down_bias is not None)
        if biased != ((True, True) if self.kind == "oai" else (False, False)):
            raise ValueError(f"ExpertAct {self.kind!r}: biases "
                             + ("required" if self.kind == "oai" else "must be None"))

    @classmethod
    def clamp(cls, limit: float) -> ExpertAct:
        """DeepSeek-V4's silu(min(g, limit)) · clamp(u, ±limit), no biases."""
        return cls(0.0, float(limit), None, None, kind="clamp")

    @property
    def code(self) -> int:
        return ACT_CODES[self.kind]

    @property
    def has_bias(self) -> bool:
        return self.gate_up_bias is not None

    def bind(self, ids: Tensor) -> ExpertAct:
        return replace(self, ids=ids)

    def to(self, device: torch.device | str) -> ExpertAct:
        dev = torch.device(device)
        on = (self.gate_up_bias is None or self.gate_up_bias.device == dev) and (
            self.ids is None or self.ids.device == dev)
        if on:
            return self
        return ExpertAct(self.alpha, self.limit, _moved(self.gate_up_bias, dev),
                         _moved(self.down_bias, dev), _moved(self.ids, dev), self.kind)

    def host_copy(self) -> ExpertAct:
        """An unbound copy with its biases on the host (the runtime's copy for the CPU
        branch)."""
        cpu = torch.device("cpu")
        return ExpertAct(self.alpha, self.limit, _moved(self.gate_up_bias, cpu, copy=True),
                         _moved(self.down_bias, cpu, copy=True), kind=self.kind)

    def entry_ids(self) -> Tensor:
        """ids [T*K] flattened (bound ids required)."""
        if self.ids is None:
            raise ValueError("ExpertAct.bind(ids) first: the biases follow the logical ids")
        return self.ids.reshape(-1)


def _moved(t: Tensor | None, dev: torch.device, copy: bool = False) -> Tensor | None:
    return None if t is None else t.detach().to(dev, copy=copy) if copy else t.to(dev)


def act_code(act: ExpertAct | None) -> int:
    """The kernels' activation code: 0 the plain SwiGLU, 1 "oai", 2 "clamp"."""
    return 0 if act is None else act.code


def glu(gu: Tensor, act: ExpertAct | None) -> Tensor:
    """gu [n, 2I] (bias already added) -> the activation [n, I] in gu's dtype."""
    i = gu.shape[-1] // 2
    g, u = gu[..., :i], gu[..., i:]
    if act is None:
        return torch.nn.functional.silu(g) * u
    if act.kind == "clamp":
        return torch.nn.functional.silu(g.clamp(max=act.limit)) * u.clamp(
            min=-act.limit, max=act.limit)
    g = g.clamp(max=act.limit)
    u = u.clamp(min=-act.limit, max=act.limit)
    return (u + 1) * (g * torch.sigmoid(g * act.alpha))


def entry_biases(act: ExpertAct | None, entries: Tensor, dtype: torch.dtype
                 ) -> tuple[Tensor | None, Tensor | None]:
    """(gate_up bias [n, 2I], down bias [n, H]) of flat entries `entries` [n] (t * K + k), in
    `dtype`; (None, None) without an act or biases ("clamp")."""
    if act is None or not act.has_bias:
        return None, None
    e = act.entry_ids().to(entries.device)[entries]  # [n] logical ids
    return act.gate_up_bias[e].to(dtype), act.down_bias[e].to(dtype)


def expert_bias_row(act: ExpertAct | None, entry: int, dtype: torch.dtype
                    ) -> tuple[Tensor | None, Tensor | None]:
    """Both bias rows [2I], [H] of the logical expert of one flat entry (a group's first);
    (None, None) without an act or biases ("clamp")."""
    if act is None or not act.has_bias:
        return None, None
    e = int(act.entry_ids()[entry])
    return act.gate_up_bias[e].to(dtype), act.down_bias[e].to(dtype)
