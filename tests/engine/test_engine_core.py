"""The batched engine against the plain single-request path (same model, greedy): batching,
chunked prefill, prefix reuse, snapshots and preemption must never change the tokens."""
from __future__ import annotations

import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import Anchor, EngineEvent, GenerateRequest, SamplingParams


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(core: EngineCore, reqs: list[GenerateRequest]) -> dict[str, list[EngineEvent]]:
    out: dict[str, list[EngineEvent]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add(r, out[r.request_id].append)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 10_000
    return out


def _tokens(evs: list[EngineEvent]) -> list[int]:
    return [t for e in evs for t in e.token_ids]


def _req(rid: str, ids: list[int], n: int, anchors: list[Anchor] | None = None) -> GenerateRequest:
    return GenerateRequest(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           anchors or [], request_id=rid)


def test_batched_equals_plain_and_reuses_prefix(tiny_hf) -> None:
    for kind in ("qwen3_5_moe", "qwen3_moe"):
        model = load_model(tiny_hf(kind), dtype=torch.float32, progress=False)
        V = model.cfg.vocab_size
        base = _prompt(V, 90, 0)
        prompts = [base + _prompt(V, 20 + 7 * i, i + 1) for i in range(5)]
        want = [generate(model, p, SamplingParams(max_tokens=12, temperature=0.0,
                                                  ignore_eos=True), []).token_ids for p in prompts]
        core = EngineCore(model, [], kv_tokens=1024, state_slots=16, max_running=3, chunk_tokens=48)
        out = _run(core, [_req(f"r{i}", p, 12) for i, p in enumerate(prompts)])
        for i in range(5):
            assert _tokens(out[f"r{i}"]) == want[i], (kind, i)
            assert out[f"r{i}"][-1].finished and out[f"r{i}"][-1].finish_reason == "length"
        # a second turn extending the first conversation reuses its prefix
        turn2 = prompts[0] + want[0] + _prompt(V, 15, 99)
        plain = generate(model, turn2, SamplingParams(max_tokens=8, temperature=0.0,
                                                      ignore_eos=True), []).token_ids
        ev = _run(core, [_req("t2", turn2, 8)])["t2"]
        assert _tokens(ev) == plain
        assert ev[0].cached_tokens >= len(prompts[0]) - 1, (kind, ev[0].cached_tokens)
        # exact repeat: everything comes from the cache on the hybrid model (its logits are
        # kept beside the prompt-end snapshot, #23), all but the last token on attention only
        ev = _run(core, [_req("rep", prompts[1], 12)])["rep"]
        assert _tokens(ev) == want[1]
        hybrid = kind == "qwen3_5_moe"
        assert ev[0].cached_tokens == len(prompts[1]) - (not hybrid), kind
        s = core.sched.stats()
        assert s["running"] == 0 and s["kv_protected"] == 0


def test_semantic_anchor_snapshot_allows_reuse_after_edit(tiny_hf) -> None:
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    head, tail = _prompt(V, 60, 5), _prompt(V, 40, 6)
    core = EngineCore(model, [], kv_tokens=1024, state_slots=16, chunk_tokens=32)
    _run(core, [_req("a", head + tail, 4, [Anchor(60, "turn_start", "user", cut_point=True)])])
    # the harness rewrote everything after the turn's opening token (a turn_start anchor is an
    # `<|im_start|>`, which the next turn repeats: the cut is snapshotted one token in, #23)
    edited = head + tail[:1] + _prompt(V, 30, 7)
    ev = _run(core, [_req("b", edited, 4)])["b"]
    assert ev[0].cached_tokens == 61  # resumed from the snapshot at the anchor, not from 0
    want = generate(model, edited, SamplingParams(max_tokens=4, temperature=0.0,
                                                  ignore_eos=True), []).token_ids
    assert _tokens(ev) == want


def test_preemption_under_kv_pressure_keeps_results(tiny_hf) -> None:
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    prompts = [_prompt(V, 70, 20 + i) for i in range(3)]
    want = [generate(model, p, SamplingParams(max_tokens=20, temperature=0.0,
                                              ignore_eos=True), []).token_ids for p in prompts]
    # 200 slots cannot hold three 90-token sequences at once: someone gets preempted
    core = EngineCore(model, [], kv_tokens=200, state_slots=12, max_running=3, chunk_tokens=64)
    out = _run(core, [_req(f"p{i}", p, 20) for i, p in enumerate(prompts)])
    for i in range(3):
        assert _tokens(out[f"p{i}"]) == want[i]
    assert core.sched.kv_alloc.num_used == core.sched.cache.stats()["kv_cached"]


def test_abort_frees_everything(tiny_hf) -> None:
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    core = EngineCore(model, [], kv_tokens=512, state_slots=8, chunk_tokens=16)
    evs: list[EngineEvent] = []
    core.add(_req("x", _prompt(model.cfg.vocab_size, 50, 1), 100), evs.append)
    for _ in range(6):
        core.step()
    core.abort("x")
    assert not core.has_work()
    s = core.sched.stats()
    assert s["kv_protected"] == 0 and s["running"] == 0
    assert core.sched.kv_alloc.num_used == s["kv_cached"]
    assert s["state_free"] + s["snapshots"] == s["state_slots"]


def test_sibling_waits_for_shared_prefill_and_reuses_it(tiny_hf) -> None:
    """Sub-agents fanned out together share a long head: the second one waits until the first
    has computed (and snapshotted) it, then prefills only its own tail."""
    for kind in ("qwen3_5_moe", "qwen3_moe"):
        model = load_model(tiny_hf(kind), dtype=torch.float32, progress=False)
        V = model.cfg.vocab_size
        head = _prompt(V, 300, 40)
        a, b = head + _prompt(V, 30, 41), head + _prompt(V, 25, 42)
        anchors = [Anchor(300, "turn_start", "user")]
        core = EngineCore(model, [], kv_tokens=2048, state_slots=16, chunk_tokens=64)
        out = _run(core, [_req("a", a, 6, anchors), _req("b", b, 6, anchors)])
        assert out["b"][0].cached_tokens >= 300 - 1, (kind, out["b"][0].cached_tokens)
        for rid, p in (("a", a), ("b", b)):
            want = generate(model, p, SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True), []).token_ids
            assert _tokens(out[rid]) == want


def test_random_pressure_configurations_keep_results(tiny_hf) -> None:
    """Random pool sizes, chunk budgets and request mixes: preemption in any order (a decode
    allocation evicting a request still waiting its turn in the same step included) never
    changes tokens, and the pools drain back."""
    import random

    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    rng = random.Random(5)
    plain: dict[tuple, list[int]] = {}
    for trial in range(6):
        n_req = rng.randint(2, 5)
        prompts = [_prompt(V, rng.randint(20, 90), 100 + trial * 10 + i) for i in range(n_req)]
        outs = [rng.randint(4, 24) for _ in range(n_req)]
        longest = max(len(p) + o for p, o in zip(prompts, outs))
        core = EngineCore(model, [], kv_tokens=longest + rng.randint(0, 60),
                          state_slots=rng.randint(2 * n_req, 3 * n_req + 4),
                          max_running=rng.randint(2, 4), chunk_tokens=rng.choice([8, 16, 48]))
        got = _run(core, [_req(f"q{i}", p, o) for i, (p, o) in enumerate(zip(prompts, outs))])
        for i, (p, o) in enumerate(zip(prompts, outs)):
            key = (tuple(p), o)
            if key not in plain:
                plain[key] = generate(model, p, SamplingParams(max_tokens=o, temperature=0.0,
                                                               ignore_eos=True), []).token_ids
            assert _tokens(got[f"q{i}"]) == plain[key], (trial, i)
        s = core.sched.stats()
        assert s["kv_protected"] == 0 and s["running"] == 0 and s["waiting"] == 0
        assert core.sched.kv_alloc.num_used == s["kv_cached"]
        assert s["state_free"] + s["snapshots"] == s["state_slots"]
