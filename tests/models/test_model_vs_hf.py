"""Our model against transformers' implementation (the oracle): logits and greedy tokens, for
every family and config spelling, through the real checkpoint path (save → load_model)."""
from __future__ import annotations

import pytest
import torch

from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.forward_batch import ForwardBatch
from tests.models.family_helpers import caches, prompt
from tests.models.fixtures import hf_reference

KINDS = ["qwen3_moe", "qwen3_moe_dense_layers", "qwen3_moe_num_local_experts", "qwen3_next",
         "qwen3_next_old_spelling", "qwen3_5_moe", "qwen3_5_moe_vl"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(tiny_hf, kind: str) -> None:
    d = tiny_hf(kind)
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    ids = prompt(ours.cfg.vocab_size, 150)  # > one 64-token delta-rule chunk, not a multiple
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # [T, V]
    c = caches(ours, 256)
    got = ours(ForwardBatch.single(ids, 0, torch.arange(150), 0, all_logits=True), c)
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    # chunked prefill (prefix reuse) + token-by-token decode must give the same logits
    c = caches(ours, 256)
    parts = [ours(ForwardBatch.single(ids[:97], 0, torch.arange(97), 0, all_logits=True), c)]
    parts.append(
        ours(ForwardBatch.single(ids[97:140], 97, torch.arange(140), 0, all_logits=True), c)
    )
    for t in range(140, 150):
        parts.append(ours(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), 0), c))
    assert (torch.cat(parts) - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_bf16_close_to_fp32_reference(tiny_hf) -> None:
    d = tiny_hf("qwen3_5_moe")
    ours, ref = load_model(d, dtype=torch.bfloat16, progress=False), hf_reference(d)
    ids = prompt(ours.cfg.vocab_size, 70, seed=2)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    cfg = ours.cfg
    c = Caches(KVPool(cfg, 128, torch.bfloat16, "cpu"), StateTensors(cfg, 1, torch.bfloat16, "cpu"))
    got = ours(ForwardBatch.single(ids, 0, torch.arange(70), 0, all_logits=True), c)
    rel = (got - want).norm() / want.norm()
    assert rel < 0.05, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_sampling_is_seeded(tiny_hf) -> None:
    ours = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    ids = prompt(ours.cfg.vocab_size, 12, seed=3)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    a = generate(ours, ids, sp, eos_ids=[]).token_ids
    b = generate(ours, ids, sp, eos_ids=[]).token_ids
    c = generate(ours, ids, SamplingParams(max_tokens=16, temperature=1.0, seed=99), eos_ids=[])
    assert a == b and a != c.token_ids


def test_stops_on_eos(tiny_hf) -> None:
    ours = load_model(tiny_hf("qwen3_moe"), dtype=torch.float32, progress=False)
    ids = prompt(ours.cfg.vocab_size, 10, seed=4)
    free = generate(ours, ids, SamplingParams(max_tokens=8, temperature=0.0), eos_ids=[])
    eos = free.token_ids[3]
    stopped = generate(ours, ids, SamplingParams(max_tokens=8, temperature=0.0), eos_ids=[eos])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_long_context_decode_matches_transformers(tiny_hf, kind: str, monkeypatch) -> None:
    """Decode rows past freetoken.kernels.cpu.attention_ops.MIN_KEYS read K/V in place from
    scattered pool slots (the C++ decode-attention kernel); their logits still match
    transformers."""
    import freetoken.kernels.cpu.attention_ops as ao

    calls: list[int] = []
    real = ao.cpu_decode_attention

    def spy(*a, **k):
        r = real(*a, **k)
        calls.append(r is not None)
        return r

    monkeypatch.setattr("freetoken.layers.attention.cpu_decode_attention", spy)
    d = tiny_hf(kind)
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    n = ao.MIN_KEYS + 40
    ids = prompt(ours.cfg.vocab_size, n, seed=3)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -8:]  # [8, V]
    c = caches(ours, 2 * n)
    slots = torch.randperm(2 * n, generator=torch.Generator().manual_seed(0))[:n]  # scattered
    ours(ForwardBatch.single(ids[:-8], 0, slots[: n - 8], 0), c)
    got = [ours(ForwardBatch.single([ids[t]], t, slots[: t + 1], 0), c) for t in range(n - 8, n)]
    assert any(calls), "the in-place kernel must have served the long decode rows"
    got_t = torch.cat(got)
    assert (got_t - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
