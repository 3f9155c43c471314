"""Prefill layer streaming (freetoken/experts/streamer.py) on the CPU device: the streamer's
buffers are slots of a CPU slot cache, filled by index copies, so the plan (lending, fills,
reading through the map, seeding) runs exactly as on the GPU, minus the streams.

Oracles: `dispatch_experts` on the full host banks (what `fused` computes, fp32 bit-identical),
the residency table's invariant battery after every chunk, and a brute-force seeding rule."""
from __future__ import annotations

import pytest
import torch

from freetoken.experts.ffn import dispatch_experts
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.stats import MoEStats
from freetoken.experts.store import ExpertStore
from freetoken.experts.streamer import (
    LayerStreamer,
    StreamCosts,
    layer_times,
    routed_experts,
    stream_threshold,
)
from tests.experts.invariants import check_tables

L, E, H, I, K = 3, 6, 32, 16, 2


def _setup(slots: int, overlap: bool = True, hits_in_place: bool = True, seed: bool = True):
    g = torch.Generator().manual_seed(0)
    gu = [torch.randn(E, 2 * I, H, generator=g) * 0.3 for _ in range(L)]
    dn = [torch.randn(E, H, I, generator=g) * 0.3 for _ in range(L)]
    store = ExpertStore(gu, dn, pin=False)
    cache = SlotCache(L, E, H, I, slots, dtype=torch.float32)
    stats = MoEStats(store.expert_bytes)
    st = LayerStreamer(cache, store, stats, threshold=2, mode="on", overlap=overlap,
                       hits_in_place=hits_in_place, seed=seed)
    return store, cache, stats, st


def _warm(cache: SlotCache, store: ExpertStore, layer: int, experts: list[int]) -> None:
    """Make `experts` of `layer` resident through the decode path (decide + fill)."""
    d = cache.decide(layer, torch.tensor([experts]), -1)
    cache.fill(layer, d.fetch_experts, d.fetch_slots, store)


def _chunk(st: LayerStreamer, store: ExpertStore, ids: list[torch.Tensor], x: torch.Tensor):
    """One streamed forward over every layer; returns each layer's y and fused's y."""
    assert st.begin_forward(x.shape[0]) and st.streaming
    got, want = [], []
    for m in range(L):
        got.append(st.forward(m, x, ids[m]))
        ref = torch.zeros(*ids[m].shape, H)
        want.append(dispatch_experts(x, ids[m], store.gate_up(m), store.down(m), ref))
    st.end_forward()
    assert not st.streaming
    return got, want


def _resident(cache: SlotCache, layer: int) -> set[int]:
    es = cache.table.expert_slot[layer * E:(layer + 1) * E]
    return {e for e in range(E) if es[e] >= 0}


def _check_weights(cache: SlotCache, store: ExpertStore) -> None:
    """Every resident expert's slot holds its weights (the slot cache contract)."""
    for s, g in enumerate(cache.table.slot_owner.tolist()):
        if g >= 0:
            m, e = divmod(g, E)
            assert torch.equal(cache.gate_up_slots[s], store.gate_up(m)[e]), (s, g)
            assert torch.equal(cache.down_slots[s], store.down(m)[e]), (s, g)


@pytest.mark.parametrize("overlap,hits_in_place", [(True, True), (False, True), (True, False)])
def test_streamed_chunk_equals_fused_bit_identical(overlap: bool, hits_in_place: bool) -> None:
    store, cache, stats, st = _setup(slots=2 * E + 4, overlap=overlap,
                                     hits_in_place=hits_in_place)
    _warm(cache, store, 0, [1, 4])
    _warm(cache, store, 2, [0])
    g = torch.Generator().manual_seed(1)
    T = 9
    x = torch.randn(T, H, generator=g)
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) for _ in range(L)]
    ids[1][3] = -1  # a padding row
    got, want = _chunk(st, store, ids, x)
    for m in range(L):
        assert torch.equal(got[m], want[m]), f"layer {m}"
    check_tables(cache.table)
    _check_weights(cache, store)
    assert st.nbuf == (2 if overlap else 1)
    # hits in place: only non-resident experts crossed the link (the 2E buffer slots of the
    # 2E + 4 were empty, so the 3 residents stayed)
    want_fetched = L * E - 3 if hits_in_place else L * E
    assert stats.streamed == want_fetched
    assert stats.stream_bytes == want_fetched * store.expert_bytes


def test_chunk_that_routes_only_resident_experts() -> None:
    """The routing misses the prefetched buffer entirely: every entry reads a resident slot."""
    store, cache, stats, st = _setup(slots=2 * E + 3 * E)
    for m in range(L):
        _warm(cache, store, m, [0, 1, 2])
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    ids = [torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]]) for _ in range(L)]
    got, want = _chunk(st, store, ids, x)
    for m in range(L):
        assert torch.equal(got[m], want[m])
        assert _resident(cache, m) == {0, 1, 2}  # nothing to seed: the residents were hottest
    check_tables(cache.table)
    _check_weights(cache, store)
    stats.sync()
    assert stats.hits == 3 * L and stats.misses == 0


def test_seeding_makes_the_most_routed_experts_resident() -> None:
    store, cache, _, st = _setup(slots=2 * E + 3)
    _warm(cache, store, 0, [0, 1])
    _warm(cache, store, 1, [5])
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(3))
    # layer 0: expert 3 routed 5x, 4 routed 4x, 0 once, 1 never -> residents {3, 4}
    ids0 = torch.tensor([[3, 4], [3, 4], [3, 4], [3, 4], [3, 0], [2, -1]])
    # layer 1: the resident 5 ties with 2 (both 2x): the resident keeps its slot
    ids1 = torch.tensor([[5, 2], [5, 2], [1, 0], [3, 4], [-1, -1], [-1, -1]])
    ids2 = torch.tensor([[0, 1]] * 6)
    before = cache.table.slot_owner.clone()
    got, want = _chunk(st, store, [ids0, ids1, ids2], x)
    for m in range(L):
        assert torch.equal(got[m], want[m])
    assert _resident(cache, 0) == {3, 4}
    assert _resident(cache, 1) == {5}
    assert _resident(cache, 2) == set()  # it had no slots: seeding keeps each layer's count
    check_tables(cache.table)
    _check_weights(cache, store)
    assert int(st.seeded) == 2
    # the hot experts took the slots of the cold residents they displaced (0 and 1)
    assert {int(cache.table.expert_slot[e]) for e in (3, 4)} == {
        int(s) for s in torch.nonzero(before == 0).flatten()} | {
        int(s) for s in torch.nonzero(before == 1).flatten()}


def test_seeding_fills_free_slots_with_the_hottest_experts() -> None:
    """An empty cache: each layer gets its share of the free slots (here 2 of 6) holding the
    experts the chunk routed most."""
    store, cache, _, st = _setup(slots=2 * E + 6)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(7))
    ids = [torch.tensor([[3, 5], [3, 5], [3, 1], [3, 0], [3, 5], [2, 4]]) for _ in range(L)]
    got, want = _chunk(st, store, ids, x)
    for m in range(L):
        assert torch.equal(got[m], want[m])
        assert _resident(cache, m) == {3, 5}
    check_tables(cache.table)
    _check_weights(cache, store)
    assert int(st.seeded) == 2 * L


def test_cpu_backend_keeps_its_static_split() -> None:
    store, cache, _, st = _setup(slots=2 * E + 2, seed=False)
    _warm(cache, store, 0, [0, 1])
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(4))
    ids = [torch.tensor([[4, 5]] * 4) for _ in range(L)]
    got, want = _chunk(st, store, ids, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _resident(cache, 0) == {0, 1}


def test_resize_between_two_chunks() -> None:
    store, cache, _, st = _setup(slots=3 * E)
    g = torch.Generator().manual_seed(5)
    for rnd, slots in enumerate([3 * E, 2 * E + 1, E + 2, 4 * E]):
        if slots != cache.num_slots:
            cache.resize(slots)
        x = torch.randn(7, H, generator=g)
        ids = [torch.randint(0, E, (7, K), generator=g) for _ in range(L)]
        got, want = _chunk(st, store, ids, x)
        for m in range(L):
            assert torch.equal(got[m], want[m]), (rnd, m)
        check_tables(cache.table)
        _check_weights(cache, store)
        assert st.nbuf == (2 if slots >= 2 * E else 1)


def test_decode_after_a_streamed_chunk_uses_the_seeded_cache() -> None:
    """After the chunk the decode path works on the table the streamer left (lent slots are
    empty, so they are the first victims) and still computes exact results."""
    store, cache, _, st = _setup(slots=2 * E + 2)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(6))
    ids = [torch.tensor([[3, 4]] * 6) for _ in range(L)]
    _chunk(st, store, ids, x)
    d = cache.decide(0, torch.tensor([[3, 5]]), -1)
    cache.fill(0, d.fetch_experts, d.fetch_slots, store)
    check_tables(cache.table)
    _check_weights(cache, store)
    assert int(d.counters[0]) == 0  # layer 0 had no slots before the chunk: nothing seeded


def test_too_small_a_cache_or_a_short_chunk_keeps_the_decode_path() -> None:
    _, _, _, st = _setup(slots=E - 1)
    assert not st.begin_forward(100) and st.wants(100) == (False, "cache_below_one_layer")
    _, _, _, st = _setup(slots=2 * E)
    st.threshold = 50
    assert not st.begin_forward(49) and not st.streaming
    assert st.begin_forward(50) and st.streaming
    st.mode = "auto"  # auto streams on CUDA only
    assert st.wants(50) == (False, "not_cuda")


def test_threshold_from_the_cost_model() -> None:
    base = {"experts": 256, "top_k": 8, "expert_bytes": 6 << 20,
            "flops_per_token_expert": 6.0 * 2048 * 512, "resident_rate": 0.37, "b_p": 52e9,
            "b_h": 88e9}
    off = stream_threshold(StreamCosts("offload", **base))
    hyb = stream_threshold(StreamCosts("hybrid", **base))
    assert off is not None and hyb is not None
    # the crossing is exact: streaming wins at the threshold and loses one token below it
    for be, t in (("offload", off), ("hybrid", hyb)):
        c = StreamCosts(be, **base)
        s, p = layer_times(c, t)
        s1, p1 = layer_times(c, t - 1)
        assert s <= p and s1 > p1
    # the CPU helps the per-expert path, so hybrid streams only from longer chunks
    assert 100 < off < hyb
    assert routed_experts(off, 8, 256) > 0.99 * 256
    # a link so slow that the layer never pays for itself against a fast CPU: never streams
    never = StreamCosts("hybrid", **{**base, "b_p": 1e6, "b_h": 1e12})
    assert stream_threshold(never, max_tokens=1 << 16) is None
