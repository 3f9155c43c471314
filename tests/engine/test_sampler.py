"""The sampler's distribution against a plain float64 reference of temperature / top-k / top-p,
and its stop-id masking (min_tokens, ignore_eos)."""
from __future__ import annotations

import math

import pytest
import torch

from freetoken.sampler import RequestSampler
from freetoken.types.api import SamplingParams


def reference(logits: list[float], t: float, top_k: int, top_p: float) -> list[float]:
    z = [x / t for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k:
        cut = z[order[top_k - 1]]
        z = [x if x >= cut else -math.inf for x in z]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    s = sum(e)
    p = [x / s for x in e]
    keep, acc = set(), 0.0
    for i in sorted(range(len(p)), key=lambda i: -p[i]):
        if acc >= top_p:
            break
        keep.add(i)
        acc += p[i]
    q = [p[i] if i in keep else 0.0 for i in range(len(p))]
    return [x / sum(q) for x in q]


@pytest.mark.parametrize("t,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                            (0.9, 12, 0.5), (2.0, 1, 1.0), (1.0, 0, 1e-6)])
def test_distribution_matches_reference(t: float, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(int(t * 100) + top_k)
    logits = torch.randn(40, generator=g, dtype=torch.float64) * 3
    s = RequestSampler(SamplingParams(temperature=t, top_k=top_k, top_p=top_p, seed=1), [])
    got = s.probs(logits)
    got = (got / got.sum()).tolist()
    want = reference(logits.tolist(), t, top_k, top_p)
    assert all(abs(a - b) < 1e-9 for a, b in zip(got, want))


def test_empirical_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    s = RequestSampler(SamplingParams(temperature=1.0, top_p=0.9, seed=7), [])
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[s.sample(logits, 0)] += 1
    want = torch.tensor(reference(logits.tolist(), 1.0, 0, 0.9))
    assert (counts / 4000 - want).abs().max() < 0.03
    assert counts[4] == 0  # outside the top-p set


def test_stop_ids_masked_until_min_tokens_and_with_ignore_eos() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0])  # id 1 (eos) is the argmax
    s = RequestSampler(SamplingParams(temperature=0.0, min_tokens=2), eos_ids=[1])
    assert s.sample(logits, 0) == 2 and s.sample(logits, 2) == 1
    assert not s.is_stop(1, 1) and s.is_stop(1, 2)
    s = RequestSampler(SamplingParams(temperature=0.0, ignore_eos=True), eos_ids=[1])
    assert s.sample(logits, 10) == 2 and not s.is_stop(1, 10)
