"""Decode steps held to their counts (issue 20: `ft bench decode` 16% slower since e194b5d, and
`fused` served at 0.61x the bench): ops and host syncs per steady decode step, counted on the
CPU by `freetoken.bench.step_ops`, not timed.

Bugs caught: the trace replay `ft bench decode` routes its `random` case by launched ~7 small
kernels per MoE layer (remainder, index_select, add, remainder, index_select, ~mask,
masked_fill): 140 of them in the 20-layer bench's CUDA graph, a step of ~270 others, so the
bench measured its own router (fused 452 vs 536 tok/s); the served step regaining a host read
or an op outside the captured region (each costs a launch or a sync on the H200, at ~2 ms a
step)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.bench import decode_drivers as dd
from freetoken.bench import step_ops
from freetoken.models.routing_hooks import TraceRouter, install_trace

PROMPT = list(range(10, 42))


def test_trace_router_replays_the_trace() -> None:
    """The laid-out lookup against the formula it replaces (numpy oracle): row r of MoE layer
    l at step s = trace[s % steps, l % Lt, (l // Lt + r) % N]; -1 outside the row mask."""
    g = np.random.default_rng(3)
    steps, lt, n, k, L = 5, 2, 3, 2, 5
    t = g.integers(0, 16, size=(steps, lt, n, k))
    r = TraceRouter(t, num_experts=16, top_k=k, max_rows=3)
    r.bind(L)
    for s in range(2 * steps + 1):  # wraps around the trace twice
        rows = 1 + s % 3
        mask = torch.tensor([True, False, True][:rows]) if s % 2 else None
        for layer in range(L):
            got = r.ids(layer, rows, mask).tolist()
            want = [[-1] * k if mask is not None and not mask[i]
                     else t[s % steps, layer % lt, (layer // lt + i) % n].tolist()
                     for i in range(rows)]
            assert got == want, (s, layer, rows)
        r.advance()
    assert int(r.step) == (2 * steps + 1) % steps  # the counter stays in [0, steps)


def _count(cfg, backend: str, trace: bool, steps: int = 4) -> step_ops.StepLog:
    model, rt = dd.build(cfg, backend)
    if trace:
        L = len(model.moe_blocks())
        u = np.argsort(np.random.default_rng(0).random((64, L, 1, cfg.num_experts)), -1)
        install_trace(model, TraceRouter(u[..., :cfg.top_k], cfg.num_experts, cfg.top_k))
    return dd.count_steps(dd.BenchSteps(model, rt), PROMPT, steps)


@pytest.mark.parametrize("layers", [4, 8])
def test_trace_routing_costs_a_few_ops_a_step_not_a_few_a_layer(layers: int) -> None:
    cfg = dd.tiny_config(layers=layers)
    own, traced = _count(cfg, "fused", False), _count(cfg, "fused", True)
    extra = traced.launches("graph") / traced.steps - own.launches("graph") / own.steps
    # the step's frame (index_select, ~mask, masked_fill) and the counter (add_, remainder_)
    assert extra <= 5, f"{extra} more ops a step with {layers} layers (was ~7 a layer)"
    mid = own.by_layer()[1], traced.by_layer()[1]  # a middle layer reads a view: no op
    assert len(mid[0]) == len(mid[1])


def test_served_step_matches_the_bench_step() -> None:
    """The server's EngineCore step (buckets 1/2/4, a 262k-token KV pool, 64 state slots, the
    host tier) runs the same captured region as `ft bench decode`'s, and outside it only: the
    staging upload, the read back of the sampled ids, the host-side slot bookkeeping."""
    cfg = dd.tiny_config()
    model, rt = dd.build(cfg, "fused")
    bench = dd.count_steps(dd.BenchSteps(model, rt), PROMPT, 4)
    model, rt = dd.build(cfg, "fused")
    served = dd.count_steps(dd.CoreSteps(model, rt, served=True), PROMPT, 4)
    for log in (bench, served):
        assert log.launches("graph") % log.steps == 0
    assert served.launches("graph") / served.steps == bench.launches("graph") / bench.steps
    n = served.steps
    host = {k: v / n for k, v in served.host_sites().items()}
    # outside the graph, per step: the one upload of the staged inputs, the read back of
    # the ids into the pinned buffer, and host-tensor work of the scheduler (KV slot
    # allocation, the row of the step ahead); none of it may be a device launch in a loop
    assert sum(host.values()) <= 5, host
    uploads = [k for k in host if k.startswith("copy_") and "_upload" in k]
    assert len(uploads) == 1 and host[uploads[0]] == 1, host
    syncs = {k.split(" @ ")[1].split(":")[0] + " " + k.split(" ")[0]: v / n
             for k, v in served.sync_sites().items()}
    # the one device read a step needs (the sampled ids, from the pinned buffer the copy
    # landed in) and two reads of host tensors (the row's KV slot, its slot list); a new
    # site here is a new host sync on the GPU unless it reads a host tensor
    assert syncs == {"engine/graph_runner.py tolist": 1, "engine/step_inputs.py int": 1,
                     "engine/decode_staging.py numpy": 1}, syncs


def test_host_path_emulation_streams_every_token() -> None:
    """`profile_decode.py --host-path`: the stubbed device decodes through the bench loop, the
    server's EngineCore and the whole HTTP stack; every forced token reaches the client and
    the engine's decode_phases cover the stream (counts, not times)."""
    from freetoken.bench.host_path import emulated_device, served_http_ms

    cfg = dd.tiny_config(vocab=151936)
    with emulated_device(1.0):
        model, rt = dd.build(cfg, "fused")
        res = served_http_ms(model, rt, 60)
    assert res["tokens"] == 60, res
    assert res["ms"] >= 1.0 * 0.9, res  # no faster than the device it waits for
    assert res["phases_ms"]["wait_s"] > 0, res
