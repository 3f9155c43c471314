"""`--record-routing FILE`: hook every MoE block's router and save the routed expert ids.

Decode steps (one token in the batch) are recorded per step and layer; multi-token batches
(prefill chunks) are recorded as prefill routing. With several concurrent requests the decode
record interleaves them: record single-stream sessions for clean traces.
"""
from __future__ import annotations

import atexit

import torch

from freetoken.experts.routing import RoutingRecorder
from freetoken.log import get_logger, kv
from freetoken.models.qwen import QwenMoE

log = get_logger("experts")


def attach_recorder(model: QwenMoE, path: str | None = None) -> RoutingRecorder:
    """Install the hooks; with `path`, also save there at interpreter exit."""
    blocks = model.moe_blocks()
    cfg = model.cfg
    rec = RoutingRecorder(len(blocks), cfg.num_experts, cfg.top_k)
    for m, b in enumerate(blocks):
        def hook(_layer_id: int, ids: torch.Tensor, _m: int = m) -> None:
            if ids.shape[0] == 1:
                rec.record(_m, ids[0])
            else:
                rec.record_prefill(_m, ids)

        b.route_hook = hook
    if path:
        def save() -> None:
            rec.save(path)
            log.info(kv("routing_saved", path=path, steps=rec.steps))

        atexit.register(save)
    return rec
