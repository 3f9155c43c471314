"""EngineCore's decode overlap: a decode step through the runner is left in flight and the next
step() launches the step after it (its rows fed the in-flight step's sampled ids on the device)
before post-processing the first. On the CPU the runner's launch is synchronous but the
bookkeeping is the same as on CUDA. Oracles: the eager engine (no runner) for tokens, a fresh
engine with no cache for a follow-up turn that resumes from the committed end of a request that
stopped on a token, and the allocators' counts for aborts in flight."""
from __future__ import annotations

import torch

from freetoken.engine.core import EngineCore
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams
from tests.engine.test_engine_core import _prompt, _run
from tests.engine.test_engine_core import _tokens as _toks


def _core(model, runner: bool, eos=(), **kw) -> EngineCore:
    return EngineCore(model, list(eos), kv_tokens=768, state_slots=12, max_running=4,
                      chunk_tokens=32, decode_runner=runner, **kw)


def _clean(core: EngineCore) -> None:
    s = core.sched.stats()
    assert s["kv_protected"] == 0 and s["running"] == 0
    assert core.sched.kv_alloc.num_used == s["kv_cached"]
    assert s["state_free"] + s["snapshots"] == s["state_slots"]


def test_overlapped_decode_equals_eager_with_stops(tiny_hf) -> None:
    """Requests ending by stop token, by stop id after min_tokens and by length, decoding
    together: the same tokens and finish reasons as the eager engine, with steps really
    launched ahead, and nothing leaked when all are done."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    prompts = [_prompt(V, 12 + 5 * i, 10 + i) for i in range(4)]
    free = _run(_core(model, False), [GenerateRequest(
        p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), request_id=f"f{i}")
        for i, p in enumerate(prompts)])
    # eos ids the requests will meet: a token each of three of them samples along the way
    stop = sorted({_toks(free[f"f{i}"])[3 + i] for i in range(3)})
    reqs = [GenerateRequest(p, SamplingParams(max_tokens=9 + 4 * i, temperature=0.0,
                                              ignore_eos=i == 3, min_tokens=i,
                                              stop_token_ids=[11]), request_id=f"o{i}")
            for i, p in enumerate(prompts)]
    eager = _run(_core(model, False, stop), reqs)
    core = _core(model, True, stop)
    fast = _run(core, reqs)
    assert {k: _toks(v) for k, v in fast.items()} == {k: _toks(v) for k, v in eager.items()}
    assert ([v[-1].finish_reason for v in fast.values()]
            == [v[-1].finish_reason for v in eager.values()])
    assert any(v[-1].finish_reason == "stop" for v in eager.values())
    assert core.steps_ahead > 5
    _clean(core)


def test_stop_with_a_step_in_flight_commits_what_the_state_covers(tiny_hf) -> None:
    """A request stops on a token while the step after it is in flight: that step fed the stop
    token, so the request's state covers it. Bug caught: committing the prefix without it while
    donating that state: a follow-up turn resumed there then sees the stop token twice and
    decodes other tokens than a fresh engine with no cache."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    prompt = _prompt(V, 30, 3)
    free = _toks(_run(_core(model, False), [GenerateRequest(
        prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        request_id="probe")])["probe"])
    stop_tok = free[6]
    first = free.index(stop_tok)
    core = _core(model, True, [stop_tok])
    a = _run(core, [GenerateRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0),
                                    request_id="a")])["a"]
    assert _toks(a) == free[:first + 1] and a[-1].finish_reason == "stop"
    assert core.steps_ahead > 0
    follow = prompt + _toks(a) + _prompt(V, 9, 4)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    b = _run(core, [GenerateRequest(follow, sp, request_id="b")])["b"]
    want = _toks(_run(_core(model, False), [GenerateRequest(follow, sp, request_id="b")])["b"])
    assert _toks(b) == want
    assert b[-1].cached_tokens >= len(prompt) + first  # resumed at the end of turn a
    _clean(core)


def test_abort_with_a_step_in_flight(tiny_hf) -> None:
    """Aborting a request between steps while its next step is in flight: its row is dropped
    when the step completes, the other request runs to its length, and every KV and state slot
    is accounted for at the end."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    core = _core(model, True)
    got: dict[str, list[int]] = {"x": [], "y": []}
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for rid, seed in (("x", 1), ("y", 2)):
        core.add(GenerateRequest(_prompt(V, 25, seed), sp, request_id=rid),
                 lambda e, rid=rid: got[rid].extend(e.token_ids))
    aborted = False
    while core.has_work():
        core.step()
        if not aborted and len(got["x"]) >= 5:
            assert core.overlap.current is not None  # the abort lands on a step in flight
            core.abort("x")
            aborted = True
    assert aborted and len(got["x"]) < 20 and len(got["y"]) == 20
    _clean(core)


def test_resize_with_a_step_in_flight(tiny_hf) -> None:
    """The expert cache re-budgeted between steps while a decode step is in flight (the server
    runs `resize_experts` between steps): the next launch drops the runner's graphs and waits
    for the step in flight, then still chains on its ids (kept in the device buffer), and the
    engine reads the first step's ids afterwards. Tokens stay the eager engine's. Bug caught:
    ids lost or read from the wrong pinned buffer across that drain."""
    from freetoken.cli.build import load_with_experts
    from freetoken.types.config import MoEConfig

    d = tiny_hf("qwen3_5_moe")
    model, rt = load_with_experts(d, MoEConfig(backend="offload", cache_size=6),
                                  dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(_prompt(V, 20, 7 + i), sp, request_id=f"r{i}") for i in range(2)]
    want = {k: _toks(v) for k, v in _run(_core(model, False, moe=rt), reqs).items()}
    core = _core(model, True, moe=rt)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add(r, lambda e, rid=r.request_id: got[rid].extend(e.token_ids))
    resized = False
    while core.has_work():
        core.step()
        if not resized and len(got["r0"]) >= 4 and core.overlap.current is not None:
            core.resize_experts(slots=9)
            resized = True
    assert resized and got == want
    assert rt.cache.num_slots == 9
    _clean(core)


def test_overlapped_steps_are_timed_once(tiny_hf) -> None:
    """/v1/stats' decode rate divides tokens by the steps' summed time. Overlapped steps run
    launch-to-tokens across two step() calls each; charged that way, their times would sum to
    about twice the wall time and halve the reported rate."""
    import time

    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    core = _core(model, True)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(2):
        core.add(GenerateRequest(_prompt(V, 10, 20 + i), sp, request_id=f"t{i}"), lambda e: None)
    t0 = time.perf_counter()
    while core.has_work():
        core.step()
    wall = time.perf_counter() - t0
    busy = sum(s[1] for s in core.stats._steps)
    assert core.steps_ahead > 20
    assert busy <= wall * 1.02, (busy, wall)


def test_full_batch_keeps_overlapping_while_others_wait(tiny_hf) -> None:
    """Six requests, two running at a time: while the batch is full the waiting ones cannot be
    admitted anyway, so the running pair keeps overlapping; a finished request makes room and
    the next one is admitted one step later. Tokens stay the eager engine's."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(_prompt(V, 9 + i, 60 + i), sp, request_id=f"w{i}") for i in range(6)]

    def core(runner: bool) -> EngineCore:
        return EngineCore(model, [], kv_tokens=768, state_slots=12, max_running=2,
                          chunk_tokens=32, decode_runner=runner)

    want = {k: _toks(v) for k, v in _run(core(False), reqs).items()}
    c = core(True)
    assert {k: _toks(v) for k, v in _run(c, reqs).items()} == want
    # three waves of two; each overlaps for most of its 11 decode steps (only the last wave
    # would, if any waiting request stopped the overlap)
    assert c.steps_ahead >= 24, c.steps_ahead
    _clean(c)
