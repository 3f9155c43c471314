"""FP8 block-scaled checkpoints (Qwen3.6-FP8, DeepSeek-V3 layout): every quantized linear
`X.weight` (float8_e4m3fn [R, C]) has a companion `X.weight_scale_inv` (float32 or bf16
[ceil(R / B), ceil(C / B)], B = `weight_block_size`), and w = weight * scale_inv blockwise.

The reader keeps the routed experts in FP8: each layer's experts become one `QuantBank` pair
(gate_up [E, 2I, H] with the gate and up grids side by side, down [E, H, I]), which stays FP8 in
the host store, over the link and in the GPU slots. Every other quantized linear (attention, the
shared expert, dense MLPs) is small beside them and is dequantized to the model dtype at load.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from freetoken.checkpoint.layout import Shape
from freetoken.kernels.quant import QuantBank, expand_block_scale
from freetoken.types.model_config import ModelConfig

SCALE_SUFFIX = "_scale_inv"
# the linears Qwen3.6-FP8 stores in FP8: the routed and shared experts and the attention
# projections (the router, norms, embeddings, lm_head and the linear-attention layers stay
# BF16); what `ft bench checkpoint` writes for an FP8 shape, and the parity test's checkpoint
_FP8_LINEARS = (".experts.", ".shared_expert.", ".self_attn.q_proj.", ".self_attn.k_proj.",
                ".self_attn.v_proj.", ".self_attn.o_proj.")


def is_fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a released FP8 Qwen checkpoint stores tensor `name` in FP8."""
    return name.endswith(".weight") and len(shape) == 2 and any(p in name for p in _FP8_LINEARS)


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def quantized_weights(found: dict, expected: dict[str, Shape], block: int) -> dict[str, str]:
    """Expected `*.weight` names stored as FP8 -> their scale names; raises ValueError when a
    scale grid does not match its weight (`found`: name -> info with `.shape`)."""
    out = {}
    for name, shape in expected.items():
        s = scale_name(name)
        if not name.endswith(".weight") or s not in found:
            continue
        want = (math.ceil(shape[0] / block), math.ceil(shape[1] / block))
        if tuple(found[s].shape) != want:
            raise ValueError(f"tensor {s}: expected block-scale shape {list(want)} for "
                             f"{name} {list(shape)} with {block}x{block} blocks, found "
                             f"{list(found[s].shape)}")
        out[name] = s
    return out


def dequantize_weight(weight: Tensor, scale_inv: Tensor, block: int,
                      dtype: torch.dtype) -> Tensor:
    """A dense [R, C] weight in `dtype` from FP8 and its block scales (float32 math)."""
    s = expand_block_scale(scale_inv.float(), weight.shape[0], weight.shape[1], block, 1)
    return (weight.float() * s).to(dtype).contiguous()


def load_fp8_experts(cfg: ModelConfig, layer: int, raw, block: int
                     ) -> tuple[QuantBank, QuantBank]:
    """(gate_up, down) FP8 banks of one MoE layer from its per-expert tensors; `raw(name)`
    reads a tensor as stored. E experts, I moe intermediate, H hidden."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    nb, cb = math.ceil(I / block), math.ceil(H / block)
    nbd, cbd = math.ceil(H / block), math.ceil(I / block)
    gu = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn)  # [E, 2I, H]
    gus = torch.empty(E, 2 * nb, cb, dtype=torch.float32)  # [E, 2 nb, cb] gate grid | up grid
    dn = torch.empty(E, H, I, dtype=torch.float8_e4m3fn)  # [E, H, I]
    dns = torch.empty(E, nbd, cbd, dtype=torch.float32)
    p = f"{cfg.weight_prefix}layers.{layer}.{cfg.moe_module}.experts."
    g, u, d = cfg.expert_names
    for e in range(E):
        for rows, scale_rows, proj in ((slice(0, I), slice(0, nb), g),
                                       (slice(I, 2 * I), slice(nb, 2 * nb), u)):
            w = f"{p}{e}.{proj}.weight"
            gu[e, rows].copy_(_fp8(raw(w), w))
            gus[e, scale_rows].copy_(raw(scale_name(w)))
        w = f"{p}{e}.{d}.weight"
        dn[e].copy_(_fp8(raw(w), w))
        dns[e].copy_(raw(scale_name(w)))
    return (QuantBank(gu, gus, "fp8", block, 2, H), QuantBank(dn, dns, "fp8", block, 1, I))


def _fp8(t: Tensor, name: str) -> Tensor:
    if t.dtype != torch.float8_e4m3fn:
        raise ValueError(f"tensor {name}: an FP8 checkpoint's expert weight must be "
                         f"float8_e4m3fn, found {t.dtype}")
    return t
