"""DeepSeek-V4 (`deepseek_v4`) against transformers' `DeepseekV4ForCausalLM` (the oracle), fp32:
the whole prompt in one prefill; chunks that start inside compression windows over a cached
prefix on scattered pool slots, then decode rows; two sequences packed in one batch. Prompts
are long enough that the CSA indexer picks 3 of up to 17 entries, HCA entries close, and the
window (8) slides; the tests that can fail check that each piece changes the logits."""
from __future__ import annotations

import pytest
import torch

from freetoken.types.forward_batch import ForwardBatch
from tests.models.v4_helpers import pool, rel, run, tiny_v4

REL = 1e-5


@pytest.fixture(scope="module")
def pair():
    return tiny_v4()


def _ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _want(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def test_whole_prompt_matches(pair) -> None:
    ref, ours = pair
    ids = _ids(70)
    assert rel(run(ours, pool(ours, 128), ids, 0, torch.arange(70)), _want(ref, ids)) <= REL


@pytest.mark.parametrize("cuts", [(13, 41), (8, 16), (1, 2), (30, 33)])
def test_chunks_over_a_cached_prefix_then_decode(pair, cuts) -> None:
    """Chunk boundaries inside and on window edges (rates 4 and 8); slots scattered."""
    ref, ours = pair
    ids, L = _ids(60, seed=1), 60
    want = _want(ref, ids)
    c = pool(ours, 256)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(2))[:L]
    a, b = cuts
    parts = [run(ours, c, ids[:a], 0, slots[:a]), run(ours, c, ids[a:b], a, slots[:b])]
    parts += [run(ours, c, [ids[t]], t, slots[:t + 1]) for t in range(b, L)]
    assert rel(torch.cat(parts), want) <= REL


def test_two_sequences_in_one_batch(pair) -> None:
    """A decode row beside a prefill chunk of another sequence, in one packed forward."""
    ref, ours = pair
    x, y = _ids(40, seed=3), _ids(25, seed=4)
    wx, wy = _want(ref, x), _want(ref, y)
    c = pool(ours, 256)
    sx, sy = torch.arange(0, 40), torch.arange(100, 125)
    run(ours, c, x[:39], 0, sx[:39])
    run(ours, c, y[:10], 0, sy[:10])
    batch = ForwardBatch(
        input_ids=torch.tensor([x[39]] + y[10:]), positions=torch.tensor([39] + list(range(10, 25))),
        new_lens=[1, 15], prefix_lens=[39, 10], kv_slots=[sx, sy], state_slots=[],
        logits_rows=torch.arange(16))
    out = ours(batch, c)
    assert rel(out[:1], wx[39:]) <= REL and rel(out[1:], wy[10:]) <= REL


def test_each_piece_changes_the_logits(pair, monkeypatch) -> None:
    """The oracle would not notice a missing piece if it did not matter: the CSA indexer's
    pick (every entry instead of the top 3), the compressed entries, the sinks, the hash
    routing and the experts' clamp each move the logits far past REL."""
    ref, ours = pair
    ids = _ids(70, seed=5)
    want = _want(ref, ids)

    def off() -> float:
        return rel(run(ours, pool(ours, 128), ids, 0, torch.arange(70)), want)

    assert off() <= REL
    for layer in ours.model.layers:
        ix = getattr(layer.self_attn.compressor, "indexer", None)
        if ix is not None:
            monkeypatch.setattr(ix, "topk", 10_000)
    assert off() > 1e-3
    monkeypatch.undo()
    with torch.no_grad():
        w = ours.model.layers[0].self_attn.compressor.kv_proj.weight  # HCA: entries -> 0
        old = w.clone()
        w.zero_()
        assert off() > 1e-3
        w.copy_(old)
        s = ours.model.layers[2].self_attn.sinks
        old = s.clone()
        s.zero_()
        assert off() > 1e-3
        s.copy_(old)
        t = ours.model.layers[0].mlp.gate.tid2eid
        old = t.clone()
        t.copy_(t.roll(1, dims=0))
        assert off() > 1e-3
        t.copy_(old)
    for layer in ours.model.layers:
        monkeypatch.setattr(layer.mlp, "limit", 1e9)
    assert off() > 1e-3
    monkeypatch.undo()
    assert off() <= REL


def test_pool_entry_and_config() -> None:
    _, ours = tiny_v4()
    cfg = ours.cfg
    assert cfg.dsv4 is not None and cfg.dsv4.kinds == ("hca", "csa", "sliding", "csa")
    assert cfg.dsv4.hash_layers == (0,)
    assert cfg.kv_entry == (1, 2 * 32 + 16, 4 * 32 + 4 * 16)


@pytest.mark.parametrize("elems", [1, 40_000])
def test_query_blocks_match_one_block(pair, monkeypatch, elems: int) -> None:
    """A long chunk runs in blocks of queries, each over its own window keys: blocks of 1 and
    of a few rows give transformers' logits too."""
    import freetoken.layers.compressed_attention as ca

    ref, ours = pair
    ids = _ids(70, seed=6)
    monkeypatch.setattr(ca, "_SCORE_ELEMS", elems)
    assert rel(run(ours, pool(ours, 128), ids, 0, torch.arange(70)), _want(ref, ids)) <= REL
