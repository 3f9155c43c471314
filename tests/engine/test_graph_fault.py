"""A CUDA graph-replay fault is recoverable (issue 22): when a replayed decode graph raises, or
returns a row it poisoned, the runner drops its graphs and decodes eagerly from then on, the
engine re-runs the rows concerned alone from their cached prefix, and every request finishes
with the tokens it gets alone (one `ft.engine: graph_fault` line says so).

The CPU has no CUDA graphs, so the runner's two graph seams stand in for them: `_capture`
returns a handle and `_replay` runs the step the graph would replay (`_forward` on the same
static buffers, with the step's own plan) — then injects the fault. The rest is the real
engine: scheduler, overlapped (chained) decode steps, caches and isolation. The injected raise
comes *after* the step ran, the worst case: every row's KV and recurrent state already moved
past the failed step, so re-running that step in place would advance them twice."""
from __future__ import annotations

import logging

import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.engine.gpu_sampler import FAILED_ROW
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams

N = 8  # tokens per request: several graph replays before and after the fault


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (6 + 4 * i,), generator=g).tolist() for i in range(4)]


def _run(core: EngineCore, prompts: list[list[int]], sp: SamplingParams
         ) -> tuple[list[list[int]], list[object]]:
    out: list[list[int]] = [[] for _ in prompts]
    errors: list[object] = [None] * len(prompts)

    def emit(ev: object, i: int) -> None:
        if isinstance(ev, BaseException):
            errors[i] = ev
        else:
            out[i].extend(ev.token_ids)  # type: ignore[attr-defined]

    for i, p in enumerate(prompts):
        core.add(GenerateRequest(p, sp, request_id=str(i)), lambda ev, i=i: emit(ev, i))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 500
    return out, errors


def _with_graphs(core: EngineCore, fault=None) -> list[tuple[int, int, int]]:
    """Stand-in graphs on the core's runner; `fault(runner, n, bucket)` runs after the n-th
    replay's step. Returns (replay number, rows of its bucket, faults known then) per
    replay."""
    runner = core.runner
    assert runner is not None
    runner.use_graphs = runner._want_graphs = True
    runner._capture = lambda bk, greedy: ("graph", bk.size, greedy)  # type: ignore[method-assign]
    calls: list[tuple[int, int, int]] = []

    def replay(graph, bk, attn, greedy) -> None:
        runner._forward(bk.size, attn, greedy)  # what the captured graph computes
        calls.append((len(calls) + 1, bk.size, runner.graph_faults))
        if fault is not None:
            fault(runner, len(calls), bk)

    runner._replay = replay  # type: ignore[method-assign]
    return calls


def _setup(tiny_hf):
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    prompts = _prompts(model.cfg.vocab_size)
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    alone = [generate(model, p, greedy, []).token_ids for p in prompts]
    return model, prompts, greedy, alone


def _core(model) -> EngineCore:
    return EngineCore(model, [], kv_tokens=2048, state_slots=16, max_running=4,
                      decode_runner=True)


def _faulted_run(tiny_hf, caplog, fault, requests: int = 4) -> None:
    model, prompts, greedy, alone = _setup(tiny_hf)
    prompts, alone = prompts[:requests], alone[:requests]
    core = _core(model)
    calls = _with_graphs(core, fault)
    with caplog.at_level(logging.INFO, logger="ft"):
        got, errors = _run(core, prompts, greedy)
    runner = core.runner
    assert errors == [None] * requests, errors
    assert got == alone  # every row, the faulted ones included, as alone
    assert len(calls) >= 2 and calls[1][1] == requests  # the fault hit a full replay
    assert runner.graph_faults == 1 and not runner.use_graphs and runner.graphs_held() == 0
    # no replay once the fault was known (a poisoned row is seen when its step is read, so
    # the step launched ahead of that read may be a replay still): eager from then on
    assert all(faults == 0 for *_, faults in calls), calls
    lines = [r.getMessage() for r in caplog.records
             if r.name == "ft.engine" and "graph_fault" in r.getMessage()]
    assert len(lines) == 1 and "graphs=off" in lines[0], lines
    assert not core.sched.running and not core.sched.waiting and not core.sched.alone
    again, errors = _run(core, prompts[-2:], greedy)  # and it keeps serving
    assert errors == [None] * len(again) and again == alone[-2:]


def test_stand_in_graphs_decode_as_the_eager_path(tiny_hf) -> None:
    """The oracle for the two fault tests: replays through the seam give the tokens of
    `generate` alone, so any difference there is the fault's."""
    model, prompts, greedy, alone = _setup(tiny_hf)
    core = _core(model)
    calls = _with_graphs(core)
    got, errors = _run(core, prompts, greedy)
    assert errors == [None] * 4 and got == alone
    assert len(calls) >= N - 2 and core.runner.replays == len(calls)
    assert max(b for _, b, _ in calls) == 4
    assert core.runner.graph_faults == 0 and core.runner.graphs_held() > 0


def _raise_second(runner, n: int, bk) -> None:
    if n == 2:
        raise RuntimeError("injected: cudaGraphLaunch failed")


def test_a_replay_that_raises_fails_no_request(tiny_hf, caplog) -> None:
    """The second replay raises after computing its step (states advanced): all four rows
    are re-run alone, eagerly, and finish with their own tokens."""
    _faulted_run(tiny_hf, caplog, _raise_second)


def test_a_replay_that_raises_under_one_request_fails_it_not(tiny_hf, caplog) -> None:
    """The same under a lone request. A failed forward of one request is that request's
    failure (engine/isolation.py), but a graph's replay failing is not: it recomputes."""
    _faulted_run(tiny_hf, caplog, _raise_second, requests=1)


def test_a_replay_that_poisons_a_row_fails_no_request(tiny_hf, caplog) -> None:
    """The second replay returns row 1 non-finite (the device sampler's FAILED_ROW, which
    alone would fail that request): it is the graph's failure, so request 1 recomputes its
    token alone, eagerly; the other rows keep the tokens of the step."""

    def poison_second(runner, n: int, bk) -> None:
        if n == 2:
            runner.out_ids[1] = FAILED_ROW

    _faulted_run(tiny_hf, caplog, poison_second)
