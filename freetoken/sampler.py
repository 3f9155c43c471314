"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators, min_tokens.

No sampling parameter that passes validation can make a draw fail: a temperature in
(0, MIN_TEMPERATURE) is sampled at MIN_TEMPERATURE (the device sampler's clamp, so both samplers
agree; 1e-300 or any subnormal used to divide the logits into inf and the draw raised), top-p
always keeps the most likely token, and a distribution that still comes out non-finite or empty
falls back to the argmax. Logits that are themselves non-finite (the largest is NaN, -inf or +inf:
the model's computation of this row failed) raise `RowFailure`, which the engine answers by failing
this request alone (`EagerStep.sample`, engine/eager.py): the other rows of the batch go on.

Shapes: B rows (one per sequence), V vocab.
"""
from __future__ import annotations

import torch

from freetoken.types.api import SamplingParams

MIN_TEMPERATURE = 1e-5  # = the clamp of freetoken/engine/gpu_sampler.sample


class RowFailure(RuntimeError):
    """One row of a batch cannot be sampled; only its request fails."""


class RequestSampler:
    """Per-request sampling state (its own torch.Generator so seeds reproduce under batching)."""

    def __init__(
        self, params: SamplingParams, eos_ids: list[int], device: torch.device | str = "cpu"
    ):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self._blocked = sorted(set(params.stop_token_ids) | set(eos_ids))
        self.gen: torch.Generator | None = None
        # the request's seed (drawn when none was given): the CPU generator's, and the device
        # sampler's counter-based noise (freetoken/engine/gpu_sampler.py) on CUDA
        self.seed = (params.seed if params.seed is not None
                     else int(torch.randint(0, 2**62, (1,)).item()))
        if params.temperature > 0:
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(self.seed)

    def blocked_ids(self, num_generated: int) -> list[int]:
        """Stop ids forbidden at this step (see `mask`)."""
        p = self.params
        return self._blocked if (p.ignore_eos or num_generated < p.min_tokens) else []

    def mask(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        """Stop ids are forbidden while `min_tokens` is not reached, and always with ignore_eos."""
        p = self.params
        if self._blocked and (p.ignore_eos or num_generated < p.min_tokens):
            logits = logits.clone()
            logits[self._blocked] = float("-inf")
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution [V] (unnormalised after top-p) of temperature > 0."""
        p = self.params
        logits = logits / max(p.temperature, MIN_TEMPERATURE)  # [V]
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [V]
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = (sp.cumsum(0) - sp) < p.top_p  # the smallest prefix reaching top_p
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        return probs

    def sample(self, logits: torch.Tensor, num_generated: int) -> int:
        """logits [V] fp32 -> next token id."""
        logits = self.mask(logits, num_generated)
        # the largest logit not finite (max takes a NaN as the largest): the same rule as
        # the device sampler's `checked_argmax`
        if not bool(torch.isfinite(logits.max())):
            raise RowFailure("the model computed non-finite logits for this request")
        if self.params.temperature <= 0 or self.gen is None:
            return int(torch.argmax(logits))
        probs = self.probs(logits).cpu()  # [V]
        total = float(probs.sum())
        if not (total > 0 and total < float("inf")) or bool(torch.isnan(probs).any()):
            return int(torch.argmax(logits))  # see the module docstring
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def is_stop(self, token: int, num_generated: int) -> bool:
        return token in self.stop_ids and num_generated >= self.params.min_tokens
