"""gpt-oss's MXFP4 expert tensors as runtime banks (issue 25 item 3, the first piece): a layer
stores `experts.gate_up_proj_blocks` uint8 [E, 2I, H / 32, 16] (two e2m1 codes a byte, low
nibble first) with `experts.gate_up_proj_scales` uint8 e8m0 [E, 2I, H / 32], and likewise
`down_proj_blocks` [E, H, I / 32, 16] / `down_proj_scales` [E, H, I / 32]. gpt-oss interleaves
gate and up along the 2I rows (gate the even rows, up the odd: transformers' `_apply_gate`);
the bank layout is rows [gate | up], so the rows are regrouped — exact, since every MXFP4 scale
belongs to one row. The bytes stay MXFP4 (a `QuantBank`, freetoken/kernels/quant.py).

Not yet: the gpt_oss family itself (attention sinks, sliding-window layers, expert biases,
the clamped SwiGLU, harmony), which these banks are for.
"""
from __future__ import annotations

import torch
from torch import Tensor

from freetoken.kernels.quant import MX_BLOCK, QuantBank


def mxfp4_bank(blocks: Tensor, scales: Tensor, interleaved_gate_up: bool = False) -> QuantBank:
    """One layer's bank [E, R, C] from gpt-oss `*_blocks` [E, R, C / 32, 16] and `*_scales`
    [E, R, C / 32]; `interleaved_gate_up` for gate_up_proj (rows regrouped to [gate | up])."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    E, R, G, B = blocks.shape
    if B != MX_BLOCK // 2 or tuple(scales.shape) != (E, R, G):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                         f"expected [E, R, G, 16] and [E, R, G]")
    data = blocks.reshape(E, R, G * B)  # [E, R, C / 2]
    if interleaved_gate_up:
        if R % 2:
            raise ValueError(f"an interleaved gate_up has an even row count, got {R}")
        data = torch.cat((data[:, 0::2], data[:, 1::2]), dim=1)
        scales = torch.cat((scales[:, 0::2], scales[:, 1::2]), dim=1)
    return QuantBank(data.contiguous(), scales.contiguous(), "mxfp4", MX_BLOCK,
                     2 if interleaved_gate_up else 1, G * MX_BLOCK)
