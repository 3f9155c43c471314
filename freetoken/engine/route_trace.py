"""Replayed trained-router routing for random-weight models: `TraceRouter` (what
`ft bench decode --route-trace` installs, bench/moe.py) and `install_serve_trace`, behind the
hidden `ft serve --route-trace shared|FILE` that `ft bench serve` passes, so the served expert
cache meets realistic locality.

The server batches decode rows, so each row r of a decode step replays its own trace sequence
(`(layer // Lt + r) % N`), and the step advances once per step at the last MoE layer. A batch
is a decode step when it is a CUDA-graph bucket (`row_mask` given) or has at most
`max_rows` rows (`--max-running`); prefill chunks keep the model's own random router. The
step counter and the trace live on the device, so graphs replay the trace like eager steps.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from freetoken.log import get_logger, kv
from freetoken.models.qwen import QwenMoE

log = get_logger("engine")


def trace_path(spec: str) -> Path:
    if spec == "shared":  # a copy of ../shared/routing_traces travels with the repo
        from freetoken.experts.record import SHARED_TRACE_DIR

        return SHARED_TRACE_DIR / "decode_routing.npy"
    return Path(spec)


class TraceRouter:
    """Replaces the router's choice with a recorded one: model layer l at decode step s takes
    trace layer l % Lt of sequence (l // Lt + seq) % N, step s % steps. The trace and the step
    counter live on the model's device and the step advances there, so a replayed CUDA graph
    walks the trace like eager steps do."""

    def __init__(self, decode: np.ndarray, num_experts: int, top_k: int,
                 device: torch.device | str = "cpu"):
        assert decode.shape[-1] >= top_k and int(decode.max()) < num_experts
        self.t = torch.from_numpy(decode[..., :top_k].astype(np.int64)).to(device)  # [s,Lt,N,K]
        self.k = top_k
        self.step = torch.zeros(1, dtype=torch.int64, device=device)

    def ids(self, layer: int, seq: int = 0) -> torch.Tensor:
        steps, lt, n, _ = self.t.shape
        frame = self.t.index_select(0, self.step % steps)[0]  # [Lt, N, K]
        return frame[layer % lt, (layer // lt + seq) % n].view(1, -1)  # [1, K]

    def advance(self) -> None:
        self.step.add_(1)


class BatchTraceRouter(TraceRouter):
    """Row r of a decode batch replays its own sequence, `(layer // Lt + r) % N`."""

    def __init__(self, decode: np.ndarray, num_experts: int, top_k: int, max_rows: int,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(decode, num_experts, top_k, device)
        self.rows = torch.arange(max(max_rows, 8), device=device)  # [R]

    def batch_ids(self, layer: int, rows: int) -> torch.Tensor:
        steps, lt, n, _ = self.t.shape
        frame = self.t.index_select(0, self.step % steps)[0]  # [Lt, N, K]
        seqs = (self.rows[:rows] + layer // lt) % n  # [T]
        return frame[layer % lt].index_select(0, seqs)  # [T, K]


def install_serve_trace(model: QwenMoE, spec: str, max_rows: int = 4) -> BatchTraceRouter:
    path = trace_path(spec)
    if not path.is_file():
        raise SystemExit(f"--route-trace: no trace at {path} (shared | a .npy [steps, L, N, K])")
    device = model.model.embed_tokens.weight.device
    cfg = model.cfg
    router = BatchTraceRouter(np.load(path), cfg.num_experts, cfg.top_k, max_rows, device)
    blocks = model.moe_blocks()
    for i, b in enumerate(blocks):
        orig = b.gate.forward

        def fwd(x: torch.Tensor, row_mask: torch.Tensor | None = None, _i: int = i,
                _orig=orig) -> tuple[torch.Tensor, torch.Tensor]:
            w, ids = _orig(x, row_mask=row_mask)
            if row_mask is not None or x.shape[0] <= max_rows:
                ids = router.batch_ids(_i, x.shape[0])  # [T, K]
                if row_mask is not None:  # a graph bucket's padding rows route nowhere
                    ids = ids.masked_fill(~row_mask[:, None], -1)
                if _i == len(blocks) - 1:
                    router.advance()
            return w, ids

        b.gate.forward = fwd  # type: ignore[method-assign]
    log.info(kv("route_trace", trace=path, steps=router.t.shape[0], trace_layers=router.t.shape[1],
                sequences=router.t.shape[2], layers=len(blocks), max_rows=max_rows))
    return router
