"""Elastic VRAM (engine/elastic.py): the expert cache and the KV pool rebuilt for a new budget
while requests stream. Oracles: the same engine run without any rebuild (greedy tokens), the
allocator's and the tree's own counts for what a rebuild must keep, and a simulated device
(total memory minus another process's claim minus what the engine holds) for the watcher."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from freetoken.cache.tensors import KVPool
from freetoken.cli.build import load_with_experts
from freetoken.engine import elastic as elastic_mod
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.engine.elastic import ElasticVram
from freetoken.engine.vram_plan import VramKnobs
from freetoken.engine.vram_watch import attach_elastic
from freetoken.experts.runtime import ResizeError
from freetoken.experts.slot_cache import SlotCache
from freetoken.types.api import EngineBusy
from freetoken.types.config import MoEConfig
from tests.engine.test_engine_core import _prompt, _req, _run, _tokens

SLOTS = 16


@pytest.fixture(scope="module")
def tiny_dir(tiny_hf):
    return tiny_hf("qwen3_5_moe")


def _core(tiny_dir, kv_tokens: int = 600, runner: bool = True) -> EngineCore:
    model, rt = load_with_experts(tiny_dir, MoEConfig(backend="offload", cache_size=SLOTS),
                                  dtype=torch.float32, progress=False)
    return EngineCore(model, [], kv_tokens=kv_tokens, state_slots=12, max_running=4,
                      chunk_tokens=32, max_context=200, decode_runner=runner, moe=rt)


def _reqs(V: int, tag: str) -> list:
    return [_req(f"{tag}{i}", _prompt(V, 30 + 13 * i, i), 24) for i in range(4)]


def _held_slots(core: EngineCore) -> set[int]:
    """Every KV slot id the tree and the running requests hold."""
    out = {s for n in core.sched.cache.radix.nodes() for s in n.value.tolist()}
    for r in core.sched.running:
        out |= set(r.row.tolist())
    return out


def test_rebuild_during_streams_loses_none(tiny_dir) -> None:
    """Four streams decoding while the KV pool shrinks (live slots compacted below the new
    size) and the expert cache shrinks, then both grow back: the same greedy tokens as an
    engine never rebuilt, and a later request reuses a prefix cached before the rebuilds.
    Bugs caught: a slot id not relabelled after compaction (a stream reads another's KV), a
    runner whose staging or scratch slot still points at the old pool."""
    ref = _core(tiny_dir)
    V = ref.cfg.vocab_size
    want = {k: _tokens(v) for k, v in _run(ref, _reqs(V, "a")).items()}
    follow = _req("f", _prompt(V, 30, 0) + _prompt(V, 9, 99), 10)  # shares a0's prompt
    ref_f = _run(ref, [follow])["f"]
    want_f = _tokens(ref_f)
    assert ref_f[0].cached_tokens > 0

    core = _core(tiny_dir)
    el = ElasticVram(core, min_expert_slots=4)
    out = {r.request_id: [] for r in _reqs(V, "a")}
    for r in _reqs(V, "a"):
        core.add(r, out[r.request_id].append)
    plan = [(6, {"kv_tokens": 300, "expert_slots": 6}),
            (14, {"kv_tokens": 900, "expert_slots": SLOTS}), (20, {"kv_tokens": 700})]
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        for at, spec in plan:
            if steps == at:
                held = _held_slots(core)
                assert spec.get("kv_tokens", 10**9) >= len(held)
                res = el.rebuild(**spec)
                assert res["kv_tokens"] == spec["kv_tokens"]
                assert all(s < core.sched.kv_alloc.num_slots for s in _held_slots(core))
                assert len(_held_slots(core)) == core.sched.kv_alloc.num_used
                assert core.caches.kv.num_slots == res["kv_tokens"] + 1
                assert core.runner.scratch_kv == res["kv_tokens"]
        assert steps < 2000
    assert el.rebuilds == 3
    assert {k: _tokens(v) for k, v in out.items()} == want
    assert all(v[-1].finished for v in out.values())
    got = _run(core, [follow])["f"]
    assert _tokens(got) == want_f
    # the prefix cached across the rebuilds is reused as without them
    assert got[0].cached_tokens == ref_f[0].cached_tokens


def test_kv_shrink_refuses_what_live_requests_hold(tiny_dir) -> None:
    """A pool smaller than the tokens live requests hold is refused (ResizeError), the old
    pool still serving. Bug caught: evicting or truncating a running request's KV."""
    core = _core(tiny_dir)
    V = core.cfg.vocab_size
    for r in _reqs(V, "b"):
        core.add(r, lambda ev: None)
    for _ in range(8):
        core.step()
    live = core.sched.kv_alloc.num_used
    # (resize_kv itself: ElasticVram's context floor would refuse before the live-token check)
    with pytest.raises(ResizeError):
        elastic_mod.resize_kv(core, live - 1)
    assert core.sched.kv_alloc.num_slots == 600 and core.caches.kv.num_slots == 601


def test_injected_allocation_failure_rolls_back(tiny_dir, monkeypatch) -> None:
    """Experts shrink and KV grows; the KV allocation fails (a GPU out of memory): the expert
    cache is grown back, nothing else changed, and serving goes on with the same tokens. Then
    the reverse: KV shrinks first, the expert allocation fails, KV is restored."""
    ref = _core(tiny_dir)
    V = ref.cfg.vocab_size
    want = {k: _tokens(v) for k, v in _run(ref, _reqs(V, "c")).items()}
    core = _core(tiny_dir)
    el = ElasticVram(core, min_expert_slots=4)
    out = {r.request_id: [] for r in _reqs(V, "c")}
    for r in _reqs(V, "c"):
        core.add(r, out[r.request_id].append)
    for _ in range(5):
        core.step()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("injected")

    with monkeypatch.context() as m:
        m.setattr(elastic_mod, "new_kv_pool", oom)
        with pytest.raises(ResizeError):
            el.rebuild(expert_slots=6, kv_tokens=900)
    assert (core.moe.cache.num_slots, core.sched.kv_alloc.num_slots) == (SLOTS, 600)
    with monkeypatch.context() as m:
        m.setattr(SlotCache, "_alloc_gate_up", oom)
        with pytest.raises(ResizeError):
            el.rebuild(expert_slots=SLOTS + 4, kv_tokens=400)
    assert (core.moe.cache.num_slots, core.sched.kv_alloc.num_slots) == (SLOTS, 600)
    assert el.failures == 2 and el.rebuilds == 0
    while core.has_work():
        core.step()
    assert {k: _tokens(v) for k, v in out.items()} == want


def _sim_device(core: EngineCore, total: int, claim: list[int]):
    """Free bytes of a simulated device of `total` bytes: what another process claims
    (`claim[0]`) and what the engine holds now (expert slots and KV pool) are taken."""
    slot = core.moe.store.expert_bytes
    per_tok = KVPool.bytes_per_token(core.cfg, core.dtype)

    def read() -> int:
        ours = core.moe.cache.num_slots * slot + core.sched.kv_alloc.num_slots * per_tok
        return total - claim[0] - ours
    return read, slot


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_watcher_shrinks_on_a_claim_then_grows_back(tiny_dir) -> None:
    """The watcher, reading a simulated device: another process claims 8 slots' worth, the
    expert cache gives them back (KV untouched, above its floor); the claim goes, the cache
    grows back to its size. Streams decoding meanwhile get the tokens of an engine never
    rebuilt."""
    ref = _core(tiny_dir)
    V = ref.cfg.vocab_size
    want = {k: _tokens(v) for k, v in _run(ref, _reqs(V, "w")).items()}
    core = _core(tiny_dir)
    claim = [0]
    read, slot = _sim_device(core, 0, claim)
    margin = 2 * slot
    total = margin - read()  # at start the free memory is exactly the margin
    read, _ = _sim_device(core, total, claim)
    engine = AsyncEngine(core, tiny_dir, "tiny")
    knobs = VramKnobs(margin_bytes=margin, hysteresis_bytes=slot // 2)
    try:
        el = attach_elastic(engine, knobs, interval_s=0.02, read_free=read)
        el.min_expert_slots = 4
        results: dict = {}

        def client() -> None:
            async def go():
                async def one(r):
                    results[r.request_id] = [t async for ev in engine.generate(r)
                                             for t in ev.token_ids]
                await asyncio.gather(*(one(r) for r in _reqs(V, "w")))
            asyncio.run(go())

        th = threading.Thread(target=client)
        th.start()
        claim[0] = 8 * slot
        _wait(lambda: core.moe.cache.num_slots == SLOTS - 8, "the shrink")
        assert core.sched.kv_alloc.num_slots == 600
        claim[0] = 0
        _wait(lambda: core.moe.cache.num_slots == SLOTS, "the grow")
        th.join(timeout=60)
        assert results == want
        assert [el.last["reason"]] == ["memory_returned"] and el.rebuilds >= 2
        assert engine.stats()["vram"]["expert_slots"] == SLOTS
    finally:
        engine.shutdown()


def test_kv_growth_moves_budget_from_experts(tiny_dir) -> None:
    """Long agent contexts fill the KV pool past 85%: with no free memory above the margin,
    re-planning grows the pool (x1.5 of the live tokens) and pays for it with expert slots;
    the streams still get their tokens."""
    ref = _core(tiny_dir, kv_tokens=260)
    V = ref.cfg.vocab_size
    reqs = [_req(f"k{i}", _prompt(V, 100 + 10 * i, i), 40) for i in range(2)]
    want = {k: _tokens(v) for k, v in _run(ref, reqs).items()}
    core = _core(tiny_dir, kv_tokens=260)
    el = ElasticVram(core, knobs=VramKnobs(margin_bytes=0, hysteresis_bytes=1), kv_cap=1000,
                     min_expert_slots=4)
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add(r, out[r.request_id].append)
    grown = None
    while core.has_work():
        core.step()
        if grown is None and el.kv_live() > 0.85 * el.kv_tokens:
            live = el.kv_live()
            grown = el.replan(free_bytes=0)
            assert grown is not None and grown["reason"] == "kv_pressure"
            assert grown["kv_tokens"] >= 1.5 * live and grown["expert_slots"] < SLOTS
    assert grown is not None
    assert {k: _tokens(v) for k, v in out.items()} == want


def test_request_during_a_long_rebuild_gets_503(tiny_dir, monkeypatch) -> None:
    """A request arriving while a rebuild holds the engine thread past `rebuild_wait_s` is
    answered EngineBusy (HTTP 503 with Retry-After) and never runs; after the rebuild the
    same request is served."""
    from freetoken.server.errors import APIError

    core = _core(tiny_dir, runner=False)
    engine = AsyncEngine(core, tiny_dir, "tiny")
    real = elastic_mod.new_kv_pool
    gate = threading.Event()

    def slow(*a, **k):
        gate.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(elastic_mod, "new_kv_pool", slow)
    try:
        el = attach_elastic(engine, interval_s=0, rebuild_wait_s=0.2)
        fut = engine.submit(el.rebuild, kv_tokens=700)
        _wait(el.rebuilding.is_set, "the rebuild to start")
        req = _req("late", _prompt(core.cfg.vocab_size, 20, 5), 4)

        async def go():  # (one event loop: the engine reports admissions to it later)
            with pytest.raises(EngineBusy) as e:
                await engine.start(req)
            gate.set()
            assert (await asyncio.wrap_future(fut))["kv_tokens"] == 700
            again = [t async for ev in engine.generate(_req("late2", req.input_ids, 4))
                     for t in ev.token_ids]
            return e.value, again

        busy, again = asyncio.run(go())
        err = APIError.from_admission(busy)
        assert err.status == 503 and err.headers == {"retry-after": "1"}
        assert len(again) == 4
        assert core.sched.stats()["running"] == 0  # the withdrawn request never ran
    finally:
        gate.set()
        engine.shutdown()


@pytest.mark.gpu
def test_rebuild_recaptures_graphs_gpu(tiny_dir) -> None:
    """On CUDA with graphs: a rebuild mid-stream (KV shrink with compaction, experts shrink,
    then both grow) drops the captured graphs, the next steps capture again on the new
    buffers, and the streams get the tokens of an engine never rebuilt. Bug caught: a graph
    replayed on the old KV pool or slot buffers after a rebuild (reads freed memory)."""
    def core_cuda() -> EngineCore:
        model, rt = load_with_experts(tiny_dir, MoEConfig(backend="offload", cache_size=SLOTS),
                                      dtype=torch.float32, device="cuda", progress=False)
        return EngineCore(model, [], kv_tokens=600, state_slots=12, max_running=4,
                          chunk_tokens=32, max_context=200, moe=rt)

    ref = core_cuda()
    V = ref.cfg.vocab_size
    want = {k: _tokens(v) for k, v in _run(ref, _reqs(V, "g")).items()}
    core = core_cuda()
    el = ElasticVram(core, min_expert_slots=8)
    out = {r.request_id: [] for r in _reqs(V, "g")}
    for r in _reqs(V, "g"):
        core.add(r, out[r.request_id].append)
    steps, replays = 0, []
    while core.has_work():
        core.step()
        steps += 1
        if steps in (8, 16):
            replays.append(core.runner.replays)
            el.rebuild(**({"kv_tokens": 300, "expert_slots": 8} if steps == 8
                          else {"kv_tokens": 900, "expert_slots": SLOTS}))
            assert all(not b.graphs for b in core.runner.buckets.values())
    assert {k: _tokens(v) for k, v in out.items()} == want
    assert core.runner.replays > replays[-1]  # graphs captured again and replayed
