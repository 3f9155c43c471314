"""Decode benchmark in a real shape with random weights: every expert backend over one host
store, `fused` (all experts on the GPU) as the upper bound, each printed next to its floor.

The floor of one decode step is the expert bytes it must move from host memory: fetched
experts over the link at B_P, CPU-computed experts read at B_H (overlapped in hybrid), from the
cached `ft bench bw` profile. Routing is the random router of the random weights, or replayed
from a trace (`--route-trace`) to model a trained router's locality.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from freetoken.engine.api import SamplingParams
from freetoken.engine.generate import generate
from freetoken.experts.setup import MoEOptions, MoERuntime, configure_experts, find_profile
from freetoken.experts.store import ExpertStore
from freetoken.layers.moe import FusedExperts
from freetoken.models.qwen import QwenMoE


class TraceRouter:
    """Replaces the router's choice with a recorded one: model layer l at decode step s takes
    trace layer l % Lt of sequence (l // Lt + seq) % N, step s % steps."""

    def __init__(self, decode: np.ndarray, num_experts: int, top_k: int):
        self.t = decode  # [steps, Lt, N, K]
        assert decode.shape[-1] >= top_k and int(decode.max()) < num_experts
        self.k, self.step = top_k, 0

    def ids(self, layer: int, seq: int = 0) -> torch.Tensor:
        steps, lt, n, _ = self.t.shape
        row = self.t[self.step % steps, layer % lt, (layer // lt + seq) % n, : self.k]
        return torch.from_numpy(row.astype(np.int64)).view(1, -1)


@dataclass
class RunResult:
    backend: str
    tok_s: float
    hit_rate: float
    fetch_bytes_tok: float
    cpu_bytes_tok: float
    floor_tok_s: float | None


def install_trace(model: QwenMoE, router: TraceRouter) -> None:
    for i, b in enumerate(model.moe_blocks()):
        gate = b.gate
        orig = gate.forward

        def fwd(x: torch.Tensor, _i: int = i, _orig=orig) -> tuple[torch.Tensor, torch.Tensor]:
            w, ids = _orig(x)
            if x.shape[0] == 1:  # decode: replay; prefill keeps the random router
                ids = router.ids(_i).to(ids.device)
            if _i == len(model.moe_blocks()) - 1:
                router.step += 1
            return w, ids

        gate.forward = fwd  # type: ignore[method-assign]


def install_backend(model: QwenMoE, store: ExpertStore, backend: str, opts: MoEOptions,
                    device: torch.device) -> MoERuntime | None:
    """Give every MoE block of `model` the experts of `backend` over `store`: `fused` copies
    every bank to the device (undo with drop_fused); the others configure the slot cache."""
    if backend == "fused":
        for m, b in enumerate(model.moe_blocks()):
            fe = FusedExperts(1, 1, 1)
            fe.gate_up_proj = torch.nn.Parameter(store.gate_up(m).to(device), requires_grad=False)
            fe.down_proj = torch.nn.Parameter(store.down(m).to(device), requires_grad=False)
            b.experts = fe
        return None
    return configure_experts(model, MoEOptions(**{**opts.__dict__, "backend": backend}), device,
                             store=store)


def drop_fused(model: QwenMoE, device: torch.device) -> None:
    """Release the device copies `install_backend(..., "fused", ...)` made."""
    for b in model.moe_blocks():
        b.experts = FusedExperts(1, 1, 1)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_backend(model: QwenMoE, store: ExpertStore, backend: str, opts: MoEOptions,
                device: torch.device, prompt: list[int], n_tokens: int) -> RunResult:
    rt = install_backend(model, store, backend, opts, device)
    sp = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    generate(model, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), [])
    if rt:
        rt.stats.sync()
    s0 = {k: v for k, v in rt.stats.__dict__.items() if isinstance(v, int)} if rt else None
    res = generate(model, prompt, sp, [])
    if rt:
        rt.stats.sync()
    steps = max(1, len(res.token_ids) - 1)
    hit = fb = cb = 0.0
    floor = None
    if rt is not None:
        d = {k: rt.stats.__dict__[k] - s0[k] for k in s0}
        routed = d["hits"] + d["misses"]
        hit = d["hits"] / routed if routed else 0.0
        fb, cb = d["fetch_bytes"] / (steps + 1), d["cpu_bytes"] / (steps + 1)
        prof = find_profile(model, store.dtype)
        if prof is not None and (prof.b_p or not fb):
            bp = (prof.b_p or 1.0) * 1e9
            bh = prof.b_h * 1e9
            t = max(fb / bp, cb / bh) if backend == "hybrid" else fb / bp + cb / bh
            floor = 1.0 / t if t > 0 else None
    if backend == "fused":
        drop_fused(model, device)
    return RunResult(backend, res.decode_tps, hit, fb, cb, floor)
