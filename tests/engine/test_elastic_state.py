"""Elastic VRAM's state pool (engine/elastic_state.py): the device recurrent-state pool resized
in a rebuild while hybrid-model requests stream. Oracles: the same engine run without any
rebuild (greedy tokens, and the prefix a later request reuses), slot conservation over the
device and host pools after every rebuild (free + snapshots + working states = every slot,
each once), and the sizes and snapshots from before a rebuild that failed."""
from __future__ import annotations

import pytest
import torch

from freetoken.cache.tensors import StateTensors
from freetoken.cli.build import load_with_experts
from freetoken.engine import elastic_state
from freetoken.engine.core import EngineCore
from freetoken.engine.elastic import ElasticVram
from freetoken.experts.runtime import ResizeError
from freetoken.types.api import Anchor
from freetoken.types.config import MoEConfig
from tests.engine.test_engine_core import _prompt, _req, _run, _tokens

SLOTS, STATES, HOST = 16, 12, 8


@pytest.fixture(scope="module")
def tiny_dir(tiny_hf):
    return tiny_hf("qwen3_5_moe")


def _core(tiny_dir, host: int = HOST, runner: bool = True) -> EngineCore:
    model, rt = load_with_experts(tiny_dir, MoEConfig(backend="offload", cache_size=SLOTS),
                                  dtype=torch.float32, progress=False)
    slot = StateTensors.bytes_per_slot(model.cfg, torch.float32)
    core = EngineCore(model, [], kv_tokens=600, state_slots=STATES, max_running=4,
                      chunk_tokens=32, max_context=200, decode_runner=runner, moe=rt,
                      state_host_mem=host * slot)
    if core.cache_ops.host is not None:
        core.cache_ops.host.wait_filled()
    return core


def _reqs(V: int, tag: str) -> list:
    # a shared 40-token head ending at an anchor: a snapshot there (class head) is what a
    # later request with the same head resumes from; two turn anchors after it give each
    # stream snapshots of its own
    head = _prompt(V, 40, 7)
    return [_req(f"{tag}{i}", head + _prompt(V, 12 + 9 * i, i), 20, _ANCHORS) for i in range(4)]


_ANCHORS = [Anchor(40, "head_end"), Anchor(45, "turn_start", "user"),
            Anchor(50, "turn_start", "assistant")]


def _check_state_slots(core: EngineCore) -> None:
    """Every device state slot is free, a snapshot's or a running request's, once; every
    host slot free or a host snapshot's, once; all below the pools' sizes; the tensors one
    scratch slot larger than the pool."""
    cache = core.sched.cache
    pool, host = cache.state_pool, cache.host_pool
    dev = [s.slot for s in cache.tiers.snaps.values() if s.tier == "device"]
    work = [r.state_slot for r in core.sched.running if r.state_slot is not None]
    every = pool.free_slots() + dev + work
    assert sorted(every) == list(range(pool.num_slots)), (pool.num_slots, sorted(every))
    if host is not None:
        on_host = [s.slot for s in cache.tiers.snaps.values() if s.tier == "host"]
        assert sorted(host.free_slots() + on_host) == list(range(host.num_slots))
    st = core.caches.state
    assert st.num_slots == len(st.conv[0]) == pool.num_slots + 1
    assert core.cache_ops.state is st
    if core.runner is not None:
        assert core.runner.scratch_state == pool.num_slots


def _states(core: EngineCore) -> dict:
    """The state every snapshot (by node, either tier) and every running request (by id)
    holds now: conv + ssm of every linear layer, copied."""
    st, host, out = core.caches.state, core.cache_ops.host, {}
    for node, s in core.sched.cache.tiers.snaps.items():
        ts = ([t[s.slot] for t in st.conv + st.ssm] if s.tier == "device"
              else host.views(s.slot))
        out[node] = [t.clone() for t in ts]
    for r in core.sched.running:
        if r.state_slot is not None:
            out[r.rid] = [t[r.state_slot].clone() for t in st.conv + st.ssm]
    return out


def _same_states(before: dict, after: dict) -> None:
    """A rebuild keeps every running request's state and creates no snapshot; each snapshot
    it kept (moved, spilled or left in place) holds the state it held."""
    assert set(after) <= set(before)
    assert {k for k in before if isinstance(k, str)} <= set(after)
    for k, ts in after.items():
        assert all(torch.equal(a, b) for a, b in zip(ts, before[k])), k


def test_state_pool_rebuild_during_streams_loses_none(tiny_dir) -> None:
    """Four streams of a hybrid model while the state pool shrinks to what they hold (their
    working states: every snapshot spilled to the host tier or dropped), grows past its start,
    then shrinks again, beside KV and expert rebuilds: the same greedy tokens as an engine never
    rebuilt, and a request after them reuses the shared head as it does there. Bugs caught: a
    working slot not relabelled after compaction (a stream continues from another's state), a
    runner whose scratch slot or tensors still belong to the old pool, a snapshot relabelled to
    the wrong slot (a later resume reads another prefix's state)."""
    ref = _core(tiny_dir)
    V = ref.cfg.vocab_size
    want = {k: _tokens(v) for k, v in _run(ref, _reqs(V, "a")).items()}
    follow = _req("f", _reqs(V, "a")[0].input_ids[:40] + _prompt(V, 7, 99), 8,
                  [Anchor(40, "head_end")])
    ref_f = _run(ref, [follow])["f"]
    assert ref_f[0].cached_tokens >= 40

    core = _core(tiny_dir)
    el = ElasticVram(core, min_expert_slots=4)
    out = {r.request_id: [] for r in _reqs(V, "a")}
    for r in _reqs(V, "a"):
        core.add(r, out[r.request_id].append)
    plan = {8: {"state_slots": 4}, 14: {"state_slots": 20, "kv_tokens": 400, "expert_slots": 6},
            22: {"state_slots": 6, "kv_tokens": 700, "expert_slots": SLOTS}}
    steps, shrunk_to_working, spills = 0, False, []
    while core.has_work():
        core.step()
        steps += 1
        spec = plan.get(steps)
        if spec is not None:
            live = elastic_state.state_live(core)
            if spec["state_slots"] < live:  # (the schedule assumes 4 running states)
                spec = dict(spec, state_slots=live)
            spilled, before = core.sched.cache.stats()["snapshots_spilled"], _states(core)
            res = el.rebuild(**spec)
            spills.append(core.sched.cache.stats()["snapshots_spilled"] - spilled)
            _same_states(before, _states(core))
            assert res["state_slots"] == spec["state_slots"] == el.state_slots
            _check_state_slots(core)
            shrunk_to_working |= core.sched.cache.state_pool.num_free == 0
        assert steps < 2000
    assert el.rebuilds == 3 and shrunk_to_working
    assert spills[0] > 0  # the first shrink moved snapshots to the host tier
    assert {k: _tokens(v) for k, v in out.items()} == want
    assert all(v[-1].finished for v in out.values())
    got = _run(core, [follow])["f"]
    assert _tokens(got) == _tokens(ref_f)
    assert got[0].cached_tokens == ref_f[0].cached_tokens
    _check_state_slots(core)


def test_shrink_below_the_live_states_is_refused(tiny_dir) -> None:
    """A state pool smaller than the running requests' working states is refused with the old
    pool serving (nothing evicted, nothing moved); then shrink to exactly them and grow back:
    the streams finish with the unrebuilt engine's tokens."""
    ref = _core(tiny_dir, host=0)
    V = ref.cfg.vocab_size
    want = {k: _tokens(v) for k, v in _run(ref, _reqs(V, "b")).items()}
    core = _core(tiny_dir, host=0)
    el = ElasticVram(core, min_expert_slots=4)
    out = {r.request_id: [] for r in _reqs(V, "b")}
    for r in _reqs(V, "b"):
        core.add(r, out[r.request_id].append)
    for _ in range(6):
        core.step()
    live = elastic_state.state_live(core)
    assert live >= 4
    before = core.sched.cache.snapshots()
    with pytest.raises(ResizeError):
        el.rebuild(state_slots=live - 1)
    assert el.state_slots == STATES and core.sched.cache.snapshots() == before
    assert el.failures == 1
    el.rebuild(state_slots=live)  # no host tier: every unpinned snapshot is dropped
    _check_state_slots(core)
    assert core.sched.cache.state_pool.num_free == 0
    el.rebuild(state_slots=STATES)
    _check_state_slots(core)
    while core.has_work():
        core.step()
    assert {k: _tokens(v) for k, v in out.items()} == want


def test_injected_state_allocation_failure_rolls_back(tiny_dir, monkeypatch) -> None:
    """Experts and KV shrink, then the state pool's allocation fails (a GPU out of memory):
    the expert cache and the KV pool are grown back, the state pool and every snapshot are as
    before (the allocation comes before any eviction), and serving goes on with the same
    tokens. A state shrink whose allocation fails likewise evicts nothing."""
    ref = _core(tiny_dir)
    V = ref.cfg.vocab_size
    want = {k: _tokens(v) for k, v in _run(ref, _reqs(V, "c")).items()}
    core = _core(tiny_dir)
    el = ElasticVram(core, min_expert_slots=4)
    out = {r.request_id: [] for r in _reqs(V, "c")}
    for r in _reqs(V, "c"):
        core.add(r, out[r.request_id].append)
    for _ in range(7):
        core.step()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("injected")

    snaps = core.sched.cache.snapshots()
    assert snaps  # (the shrink below would have had snapshots to evict)
    tensors = core.caches.state
    with monkeypatch.context() as m:
        m.setattr(elastic_state, "new_state_tensors", oom)
        with pytest.raises(ResizeError):
            el.rebuild(expert_slots=6, kv_tokens=400, state_slots=STATES + 6)
        assert (el.expert_slots, el.kv_tokens, el.state_slots) == (SLOTS, 600, STATES)
        with pytest.raises(ResizeError):
            el.rebuild(state_slots=elastic_state.state_live(core))
    assert el.state_slots == STATES and core.sched.cache.snapshots() == snaps
    assert core.caches.state is tensors and el.failures == 2 and el.rebuilds == 0
    _check_state_slots(core)
    while core.has_work():
        core.step()
    assert {k: _tokens(v) for k, v in out.items()} == want


def test_replan_pays_a_large_claim_with_state_slots_then_regrows_them(tiny_dir) -> None:
    """The watcher's path: a claim larger than the experts and the KV above its floor can give
    shrinks the state pool too (to its floor of two per running request, or the live states),
    and memory returned grows it back to --state-slots before the experts; the streams keep
    the unrebuilt engine's tokens."""
    from freetoken.engine.vram_plan import VramKnobs

    ref = _core(tiny_dir)
    V = ref.cfg.vocab_size
    want = {k: _tokens(v) for k, v in _run(ref, _reqs(V, "d")).items()}
    core = _core(tiny_dir)
    el = ElasticVram(core, knobs=VramKnobs(margin_bytes=0, hysteresis_bytes=1),
                     min_expert_slots=4)
    out = {r.request_id: [] for r in _reqs(V, "d")}
    for r in _reqs(V, "d"):
        core.add(r, out[r.request_id].append)
    for _ in range(8):
        core.step()
    got = el.replan(free_bytes=-(2**40))
    assert got is not None and got["reason"] == "memory_claimed"
    assert el.expert_slots == 4 and el.state_slots == max(8, elastic_state.state_live(core))
    _check_state_slots(core)
    got = el.replan(free_bytes=2**40)
    assert got["reason"] == "memory_returned" and el.state_slots == STATES
    assert el.expert_slots == el.expert_pool
    _check_state_slots(core)
    while core.has_work():
        core.step()
    assert {k: _tokens(v) for k, v in out.items()} == want


@pytest.mark.gpu
def test_state_rebuild_recaptures_graphs_gpu(tiny_dir) -> None:
    """On CUDA with graphs: the state pool shrinks to the live states and grows back while
    four streams decode from captured graphs: the graphs go with the old state tensors, the
    next steps capture again, and the tokens are an unrebuilt engine's. Bug caught: a graph
    replayed on the freed state tensors (reads and writes freed device memory)."""
    def core_cuda() -> EngineCore:
        model, rt = load_with_experts(tiny_dir, MoEConfig(backend="offload", cache_size=SLOTS),
                                      dtype=torch.float32, device="cuda", progress=False)
        return EngineCore(model, [], kv_tokens=600, state_slots=STATES, max_running=4,
                          chunk_tokens=32, max_context=200, moe=rt, state_host_mem=0)

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
        if steps in (10, 18):
            replays.append(core.runner.replays)
            n = elastic_state.state_live(core) if steps == 10 else STATES + 4
            el.rebuild(state_slots=n)
            assert all(not b.graphs for b in core.runner.buckets.values())
            _check_state_slots(core)
    assert {k: _tokens(v) for k, v in out.items()} == want
    assert core.runner.replays > replays[-1]  # graphs captured again and replayed
