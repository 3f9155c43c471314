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
    return torch.randint(1, 256, (n,), generator=g).tolist()  # (0: the pad id hf_greedy uses)


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
        input_ids=torch.tensor([x[39]] + y[10:]),
        positions=torch.tensor([39] + list(range(10, 25))),
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


def test_greedy_and_engine_with_prefix_reuse(pair) -> None:
    """transformers' greedy tokens from the plain generation path, and from the batched engine:
    chunked prefill (chunks of 32, not window multiples) beside other requests' decode rows,
    then a second turn whose cached prefix ends inside a compression window."""
    from freetoken.engine.core import EngineCore
    from freetoken.engine.generate import generate
    from freetoken.types.api import GenerateRequest, SamplingParams
    from tests.models.family_helpers import hf_greedy

    ref, ours = pair
    ids = _ids(37, seed=7)
    got = generate(ours, ids, SamplingParams(max_tokens=12, temperature=0.0), eos_ids=[])
    assert got.token_ids == hf_greedy(ref, ids, 12)
    base = _ids(45, seed=8)
    prompts = [base + _ids(11 + 5 * i, seed=9 + i) for i in range(3)]
    core = EngineCore(ours, [], kv_tokens=1024, state_slots=8, max_running=2, chunk_tokens=32)

    def go(reqs: list[GenerateRequest]) -> dict[str, list[int]]:
        out: dict[str, list] = {r.request_id: [] for r in reqs}
        for r in reqs:
            core.add(r, out[r.request_id].append)
        while core.has_work():
            core.step()
        return {k: [t for e in v for t in e.token_ids] for k, v in out.items()}

    def req(rid: str, p: list[int], n: int) -> GenerateRequest:
        return GenerateRequest(p, SamplingParams(max_tokens=n, temperature=0.0,
                                                 ignore_eos=True), request_id=rid)

    out = go([req(f"r{i}", p, 6) for i, p in enumerate(prompts)])
    want = [hf_greedy(ref, p, 6) for p in prompts]
    assert [out[f"r{i}"] for i in range(3)] == want
    turn2 = prompts[0] + want[0] + _ids(9, seed=99)
    assert go([req("t2", turn2, 5)])["t2"] == hf_greedy(ref, turn2, 5)


@pytest.fixture(scope="module")
def v4_dir(pair, tmp_path_factory):
    """transformers' model saved as a checkpoint (what `from_pretrained` reads)."""
    d = tmp_path_factory.mktemp("v4")
    pair[0].save_pretrained(d)
    return d


def _steps(model, ids: list[int]) -> torch.Tensor:
    c = pool(model, 128)
    out = [run(model, c, ids[:30], 0, torch.arange(30))]
    out += [run(model, c, [ids[t]], t, torch.arange(t + 1)) for t in range(30, len(ids))]
    return torch.cat(out)


def test_checkpoint_loads_and_matches(pair, v4_dir) -> None:
    from freetoken.models.loader import load_model

    ref, _ = pair
    ours = load_model(v4_dir, dtype=torch.float32, progress=False)
    ids = _ids(50, seed=10)
    assert rel(_steps(ours, ids), _want(ref, ids)) <= REL


@pytest.mark.parametrize("backend,slots", [("offload", 3), ("offload", 12), ("cpu", 5),
                                           ("hybrid", 2), ("hybrid", 9), ("auto", 10)])
def test_backend_bit_identical_to_fused(v4_dir, backend: str, slots: int) -> None:
    """Every expert backend against `fused` (hash and top-k layers, the clamp act)."""
    from freetoken.cli.build import load_with_experts
    from freetoken.models.loader import load_model
    from freetoken.types.config import MoEConfig

    ids = _ids(44, seed=11)
    want = _steps(load_model(v4_dir, dtype=torch.float32, progress=False), ids)
    m, rt = load_with_experts(v4_dir, MoEConfig(backend=backend, cache_size=slots),
                              dtype=torch.float32, progress=False)
    assert torch.equal(_steps(m, ids), want)
    st = rt.counters.as_dict()
    assert st["misses"] > 0
    if backend in ("cpu", "hybrid"):
        assert st["cpu_experts"] > 0
