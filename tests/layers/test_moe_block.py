"""The MoE block's router contract on the torch path: a row mask sends padding rows nowhere,
also when `ft bench decode --route-trace` has replaced the router's forward."""
from __future__ import annotations

import numpy as np
import torch

from freetoken.bench.moe import TraceRouter, install_trace
from freetoken.models.loader import load_model


def test_router_row_mask_and_trace_replay(tiny_hf) -> None:
    """Bug it catches: the router now takes the row mask (so the fused kernel can apply it);
    the trace replay's wrapper of the router must accept and apply it too (it raised a
    TypeError, or replayed real experts for a graph bucket's padding row)."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    cfg = model.cfg
    block = model.moe_blocks()[0]
    x = torch.randn(2, cfg.hidden_size)
    mask = torch.tensor([True, False])
    _, ids0 = block.gate(x)
    _, ids = block.gate(x, row_mask=mask)
    assert torch.equal(ids[0], ids0[0]) and (ids[1] == -1).all()
    trace = np.arange(2 * 1 * 1 * cfg.top_k).reshape(2, 1, 1, cfg.top_k) % cfg.num_experts
    install_trace(model, TraceRouter(trace, cfg.num_experts, cfg.top_k))
    _, real = block.gate(x[:1], row_mask=mask[:1])
    assert real.tolist() == [trace[0, 0, 0].tolist()]
    _, pad = block.gate(x[:1], row_mask=mask[1:])
    assert (pad == -1).all()
