"""Single-request generation with private caches: the plain path behind `ft generate` and the
oracle the batched engine is tested against (same model, no sharing, no scheduling)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.models.qwen import QwenMoE
from freetoken.sampler import RequestSampler
from freetoken.types.api import SamplingParams
from freetoken.types.forward_batch import ForwardBatch


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


def generate(model: QwenMoE, prompt: list[int], sampling: SamplingParams, eos_ids: list[int],
             on_token: Callable[[int], None] | None = None, prefill_chunk: int = 2048
             ) -> GenerationResult:
    cfg = model.cfg
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    total = len(prompt) + sampling.max_tokens
    caches = Caches(KVPool(cfg, total, dtype, device),
                    StateTensors(cfg, 1, dtype, device) if cfg.has_linear_attention else None)
    slots = torch.arange(total, device=device)
    state = 0 if cfg.has_linear_attention else None
    sampler = RequestSampler(sampling, eos_ids, device)
    t0 = time.perf_counter()
    logits = None
    for s in range(0, len(prompt), prefill_chunk):
        chunk = prompt[s:s + prefill_chunk]
        logits = model(
            ForwardBatch.single(chunk, s, slots[: s + len(chunk)], state, device), caches
        )
    assert logits is not None, "empty prompt"
    _sync(device)
    t1 = time.perf_counter()
    out: list[int] = []
    reason = "length"
    while True:
        tok = sampler.sample(logits[0], len(out))
        out.append(tok)
        if on_token:
            on_token(tok)
        if sampler.is_stop(tok, len(out)):
            reason = "stop"
            break
        if len(out) >= sampling.max_tokens:
            break
        pos = len(prompt) + len(out) - 1
        logits = model(ForwardBatch.single([tok], pos, slots[: pos + 1], state, device), caches)
    _sync(device)
    return GenerationResult(out, reason, t1 - t0, time.perf_counter() - t1)
