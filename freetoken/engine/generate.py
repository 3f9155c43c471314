"""Single-request generation with private caches: the plain path behind `ft generate` and the
oracle the batched engine is tested against (same model, no sharing, no scheduling)."""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.engine.decode_staging import DecodeRow
from freetoken.engine.gpu_sampler import RowSampling, sample_rows
from freetoken.engine.graph_runner import DecodeRunner
from freetoken.experts.runtime import MoERuntime
from freetoken.models.qwen import QwenMoE
from freetoken.sampler import RequestSampler
from freetoken.types.api import SamplingParams
from freetoken.types.forward_batch import EAGER, ForwardBatch, MoEStep


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prefill_seconds: float
    decode_seconds: float

    @property
    def decode_tps(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Private:
    """The private caches of `generate` (one sequence: slots 0..total-1, state slot 0, plus one
    scratch slot of each for the decode runner) and the runner over them, kept per model (in
    `_PRIVATE`, for as long as the model lives) so repeated calls reuse the captured graphs."""

    def __init__(self, model: QwenMoE, total: int, device: torch.device, dtype: torch.dtype):
        cfg = model.cfg
        self.total = total
        state = StateTensors(cfg, 2, dtype, device) if cfg.has_linear_attention else None
        self.caches = Caches(KVPool(cfg, total + 1, dtype, device), state)
        self.runners: dict[tuple, DecodeRunner] = {}

    def runner(self, model: QwenMoE, use_graphs: bool, moe: MoERuntime | None
               ) -> DecodeRunner:
        # a backend swap (benchmarks) installs new experts: capture anew for them
        key = (use_graphs, tuple(id(b.experts) for b in model.moe_blocks()))
        if key not in self.runners:
            for r in self.runners.values():
                if r.bridge is not None and r.moe is not None:
                    r.moe.drop_bridge(r.bridge)
            self.runners.clear()
            r = DecodeRunner(model, self.caches, 1, scratch_kv=self.total,
                             scratch_state=1 if self.caches.state else None,
                             use_graphs=use_graphs, moe=moe)
            r.finish_build()  # not a server: one plan from the first step (flashinfer built)
            self.runners[key] = r
        return self.runners[key]


_PRIVATE: weakref.WeakKeyDictionary[QwenMoE, _Private] = weakref.WeakKeyDictionary()


def _private(model: QwenMoE, total: int, device: torch.device, dtype: torch.dtype) -> _Private:
    p = _PRIVATE.get(model)
    if p is None or p.total < total:
        p = _Private(model, max(total, 1024), device, dtype)
        _PRIVATE[model] = p
    if p.caches.state is not None:
        p.caches.state.reset(0)
    return p


def private_runner(model: QwenMoE) -> DecodeRunner | None:
    """The decode runner `generate` last used for `model` (benchmarks read its timers)."""
    p = _PRIVATE.get(model)
    return next(iter(p.runners.values()), None) if p is not None else None


def generate(model: QwenMoE, prompt: list[int], sampling: SamplingParams, eos_ids: list[int],
             on_token: Callable[[int], None] | None = None, prefill_chunk: int = 2048,
             cuda_graph: bool = True, moe: MoERuntime | None = None) -> GenerationResult:
    """Greedy or sampled generation of one prompt. On CUDA the decode steps run through the
    decode runner (CUDA graphs unless `cuda_graph` is False) and sample on the device. `moe`:
    the model's expert runtime (None: every expert resident)."""
    cfg = model.cfg
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    total = len(prompt) + sampling.max_tokens
    priv = _private(model, total, device, dtype)
    caches = priv.caches
    slots = torch.arange(priv.total, device=device)
    state = 0 if cfg.has_linear_attention else None
    sampler = RequestSampler(sampling, eos_ids, device)
    runner = priv.runner(model, cuda_graph, moe) if device.type == "cuda" else None
    host_slots = torch.arange(priv.total)

    def moe_step(kind: str, tokens: int) -> AbstractContextManager[MoEStep]:
        return moe.step(kind, tokens) if moe is not None else nullcontext(EAGER)

    t0 = time.perf_counter()
    logits = None
    for s in range(0, len(prompt), prefill_chunk):
        chunk = prompt[s:s + prefill_chunk]
        batch = ForwardBatch.single(chunk, s, slots[: s + len(chunk)], state, device)
        with moe_step("prefill", len(chunk)) as batch.moe:
            logits = model(batch, caches)
    assert logits is not None, "empty prompt"
    _sync(device)
    t1 = time.perf_counter()
    out: list[int] = []
    reason = "length"
    p = sampling
    def params(n: int) -> RowSampling:
        return RowSampling(p.temperature, p.top_k, p.top_p, sampler.seed, n,
                           tuple(sampler.blocked_ids(n)))

    tok = (sampler.sample(logits[0], 0) if runner is None
           else sample_rows(logits, [params(0)], device)[0])
    state_slot = 0 if state is not None else -1

    def row(n: int, token: int) -> DecodeRow:  # the step that feeds out[n - 1]
        pos = len(prompt) + n - 1
        return DecodeRow(**vars(params(n)), token=token, position=pos, out_slot=pos,
                         state_slot=state_slot, kv_slots=host_slots[: pos + 1])

    # On CUDA the next step is launched before this one's token is read (it takes the token
    # from the device): the host's staging overlaps the GPU's step (every backend: the CPU
    # bridge queues the steps begun ahead of its worker). After a stop token the one step
    # launched ahead is discarded; it wrote only slots past the sequence's end. Under `auto`
    # the steps are chained once its guard has settled (until then each step is timed alone).
    pending = None
    while True:
        out.append(tok)
        if on_token:
            on_token(tok)
        if sampler.is_stop(tok, len(out)):
            reason = "stop"
            break
        if len(out) >= sampling.max_tokens:
            break
        n = len(out)
        settled = moe is None or moe.settled
        if runner is not None and settled:
            if pending is None:
                pending = runner.launch([row(n, tok)])
            ahead = (runner.launch([row(n + 1, 0)], chain=[0])
                     if n + 1 < sampling.max_tokens else None)
            tok = runner.collect(pending)[0]
            pending = ahead
            continue
        with moe_step("decode", 1) as st:
            if runner is not None:
                tok = runner.step([row(n, tok)])[0]
            else:
                pos = len(prompt) + n - 1
                batch = ForwardBatch.single([tok], pos, slots[: pos + 1], state, device)
                batch.moe = st
                logits = model(batch, caches)
                tok = sampler.sample(logits[0], n)
    if runner is not None:
        runner.drain()
    _sync(device)
    return GenerationResult(out, reason, t1 - t0, time.perf_counter() - t1)
