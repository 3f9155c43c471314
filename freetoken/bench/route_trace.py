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
        from freetoken.bench.routing_trace import SHARED_TRACE_DIR

        return SHARED_TRACE_DIR / "decode_routing.npy"
    return Path(spec)


class TraceRouter:
    """Replaces the router's choice in decode steps with a recorded one: row r of model layer l
    at decode step s takes trace layer l % Lt of sequence (l // Lt + r) % N, step s % steps.
    The trace, the row index and the step counter live on the model's device and the step
    advances there, so a replayed CUDA graph walks the trace like eager steps do."""

    def __init__(self, decode: np.ndarray, num_experts: int, top_k: int,
                 device: torch.device | str = "cpu", max_rows: int = 8):
        assert decode.shape[-1] >= top_k and int(decode.max()) < num_experts
        self.t = torch.from_numpy(decode[..., :top_k].astype(np.int64)).to(device)  # [s,Lt,N,K]
        self.k = top_k
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.rows = torch.arange(max(max_rows, 8), device=device)  # [R]

    def ids(self, layer: int, rows: int = 1) -> torch.Tensor:
        """[rows, K]: the step's routing of `rows` decode rows (row r = sequence r)."""
        steps, lt, n, _ = self.t.shape
        frame = self.t.index_select(0, self.step % steps)[0]  # [Lt, N, K]
        seqs = (self.rows[:rows] + layer // lt) % n  # [rows]
        return frame[layer % lt].index_select(0, seqs)  # [rows, K]

    def advance(self) -> None:
        self.step.add_(1)


def uniform_trace(steps: int, layers: int, rows: int, num_experts: int, top_k: int,
                  seed: int = 0) -> np.ndarray:
    """[steps, layers, rows, K] routing drawn uniformly per token: each row of each step picks
    K distinct experts of E at random. Random weights served through real prompts route like
    this (their hit rate equals the cache rate, DESIGN §9), while a random router fed the
    benchmark's own greedy tokens does not, so this is `ft bench decode`'s `random` case."""
    g = np.random.default_rng(seed)
    out = np.empty((steps, layers, rows, top_k), dtype=np.int16)
    for s in range(steps):  # a step at a time: argsort of [L, N, E] keys stays small
        out[s] = np.argsort(g.random((layers, rows, num_experts)), axis=-1)[..., :top_k]
    return out


def install_trace(model: QwenMoE, router: TraceRouter, max_rows: int = 1) -> None:
    """Route every decode step of `model` by `router`: a CUDA-graph bucket (which passes
    `row_mask`; its padding rows route nowhere) or an eager step of at most `max_rows` rows.
    Prefill chunks keep the model's own router."""
    blocks = model.moe_blocks()
    for i, b in enumerate(blocks):
        orig = b.gate.forward

        def fwd(x: torch.Tensor, row_mask: torch.Tensor | None = None, _i: int = i,
                _orig=orig) -> tuple[torch.Tensor, torch.Tensor]:
            w, ids = _orig(x, row_mask=row_mask)
            if row_mask is not None or x.shape[0] <= max_rows:
                ids = router.ids(_i, x.shape[0])  # [T, K]
                if row_mask is not None:
                    ids = ids.masked_fill(~row_mask[:, None], -1)
                if _i == len(blocks) - 1:
                    router.advance()
            return w, ids

        b.gate.forward = fwd  # type: ignore[method-assign]


def install_serve_trace(model: QwenMoE, spec: str, max_rows: int = 4) -> TraceRouter:
    path = trace_path(spec)
    if not path.is_file():
        raise SystemExit(f"--route-trace: no trace at {path} (shared | a .npy [steps, L, N, K])")
    device = model.model.embed_tokens.weight.device
    cfg = model.cfg
    router = TraceRouter(np.load(path), cfg.num_experts, cfg.top_k, device, max_rows)
    install_trace(model, router, max_rows)
    log.info(kv("route_trace", trace=path, steps=router.t.shape[0], trace_layers=router.t.shape[1],
                sequences=router.t.shape[2], layers=len(model.moe_blocks()), max_rows=max_rows))
    return router
