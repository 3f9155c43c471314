"""The Triton decision kernel gives exactly decide_reference's outputs and tables.

On a CPU-only machine it runs under TRITON_INTERPRET=1 (tiny shapes: the interpreter is slow);
with CUDA it runs the compiled kernel on the GPU against the reference on the CPU.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from freetoken.experts.residency import ResidencyTable
from tests.experts.invariants import check_decision, check_tables
from tests.experts.test_residency import random_ids

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=[16, 1], ids=["picks", "sort"])
def small_q(request, monkeypatch) -> int:
    """Both ways the kernel picks the q smallest keys: block reductions (q <= SMALL_Q, every
    q at these shapes) and the sort (SMALL_Q = 1: every q >= 2). Bug caught: a pick loop that
    repeats a key, skips one or breaks ties differently from the sort and the reference."""
    import freetoken.kernels.triton.slot_decide as sd

    monkeypatch.setattr(sd, "SMALL_Q", request.param)
    return request.param


def same_tables(a: ResidencyTable, b: ResidencyTable) -> None:
    assert a.slot_owner.tolist() == b.slot_owner.tolist()
    assert a.expert_slot.tolist() == b.expert_slot.tolist()
    assert a.slot_last_use.tolist() == b.slot_last_use.tolist()
    assert a.clock.tolist() == b.clock.tolist()


@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_reference(seed: int, small_q: int) -> None:
    rng = random.Random(100 + seed)
    L, E, S = rng.randint(1, 3), rng.randint(4, 8), rng.randint(1, 12)
    ref, dev = ResidencyTable(L, E, S), ResidencyTable(L, E, S, device=DEVICE)
    # running counters as the stats keep them: the kernel adds each decision's in its launch
    acc_ref, acc_dev = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64,
                                                                     device=DEVICE)
    total = torch.zeros(3, dtype=torch.int64)
    for step in range(14):
        layer = rng.randrange(L)
        T, K = rng.randint(1, 4), rng.randint(1, min(4, E))
        ids = random_ids(rng, T, K, E, pad=True)
        nf = rng.choice([-1, -1, 0, 1, 3])
        # a device-tensor num_fetch is the graph-capturable form; exercise both
        nf_arg = torch.tensor(nf, device=DEVICE) if step % 2 else nf
        r = ref.decide(layer, ids, nf, accumulate=acc_ref)
        k = dev.decide(layer, ids.to(DEVICE), nf_arg, impl="triton", accumulate=acc_dev)
        total += r.counters
        assert acc_ref.tolist() == acc_dev.cpu().tolist() == total.tolist(), f"step {step}"
        for name, a, b in zip(r._fields, r, k):
            assert a.tolist() == b.cpu().tolist(), f"step {step}: {name} differs"
        same_tables(ref, dev)
        check_tables(dev)
        check_decision(dev, layer, ids.to(DEVICE), k)


@pytest.mark.parametrize("seed", range(2))
def test_fetch_table_matches_reference(seed: int, small_q: int) -> None:
    """A fetch rule per miss count (num_fetch [E+1], what captured hybrid steps pass): the
    kernel indexes it with the misses it counts; it must give the reference's q, outputs and
    tables, and the reference's q must be table[misses]. Bug caught: a table read at the wrong
    count (hits, routed experts) or as its first entry."""
    rng = random.Random(300 + seed)
    L, E, S = 2, 8, rng.randint(2, 10)
    table = [0] + [rng.choice([-1, 0, 1, m, max(1, m // 2)]) for m in range(1, E + 1)]
    ref, dev = ResidencyTable(L, E, S), ResidencyTable(L, E, S, device=DEVICE)
    t_ref, t_dev = torch.tensor(table), torch.tensor(table, device=DEVICE)
    for step in range(12):
        layer = rng.randrange(L)
        ids = random_ids(rng, rng.randint(1, 4), 3, E, pad=True)
        hits = ref.expert_slot[layer * E:(layer + 1) * E].clone()
        r = ref.decide(layer, ids, t_ref)
        k = dev.decide(layer, ids.to(DEVICE), t_dev, impl="triton")
        for name, a, b in zip(r._fields, r, k):
            assert a.tolist() == b.cpu().tolist(), f"step {step}: {name} differs"
        same_tables(ref, dev)
        seen = {int(e) for e in ids.reshape(-1) if e >= 0}
        n_miss = sum(1 for e in seen if hits[e] < 0)
        nf = table[n_miss]
        n_hit = len(seen) - n_miss
        want_q = min(n_miss if nf < 0 else min(nf, n_miss), S - n_hit)
        assert int(r.counters[2]) == want_q


def test_kernel_chunks_long_id_lists(small_q: int) -> None:
    """More ids than one BLOCK_TK chunk (T*K = 36 > 32) must still count every entry."""
    rng = random.Random(5)
    ref, dev = ResidencyTable(2, 8, 5), ResidencyTable(2, 8, 5, device=DEVICE)
    for layer in (0, 1, 0):
        ids = random_ids(rng, 9, 4, 8, pad=False)
        r, k = ref.decide(layer, ids, 2), dev.decide(layer, ids.to(DEVICE), 2, impl="triton")
        for a, b in zip(r, k):
            assert a.tolist() == b.cpu().tolist()
        same_tables(ref, dev)


@pytest.mark.gpu
def test_kernel_realistic_shapes_gpu(small_q: int) -> None:
    """Qwen3.6-sized pool (40 x 256, top-8) at 37% capacity, batch 4: GPU kernel == CPU
    reference."""
    from freetoken.bench.routing import synthetic_trace

    L, E, K, S, B = 40, 256, 8, 3789, 4
    trace = torch.from_numpy(synthetic_trace(L, E, K, 12 * B, 0.583, seed=3))  # [steps, L, K]
    ref, dev = ResidencyTable(L, E, S), ResidencyTable(L, E, S, device="cuda")
    for step in range(12):
        for layer in range(L):
            ids = trace[step * B:(step + 1) * B, layer]  # [B, K]: a batch of 4 sequences
            nf = 5 if layer % 3 == 0 else -1
            r = ref.decide(layer, ids, nf)
            k = dev.decide(layer, ids.cuda(), torch.tensor(nf, device="cuda"), impl="triton")
            for name, a, b in zip(r._fields, r, k):
                assert a.tolist() == b.cpu().tolist(), f"{step}/{layer}: {name} differs"
    same_tables(ref, dev)


@pytest.mark.gpu
def test_decide_step_replays_from_cuda_graph() -> None:
    """A whole decode step's decisions (every layer) captured once, replayed on new routing."""
    from freetoken.bench.routing import synthetic_trace

    L, E, K, S = 6, 64, 8, 100
    trace = torch.from_numpy(synthetic_trace(L, E, K, 20, 0.5, seed=9))  # [steps, L, K]
    warm = ResidencyTable(L, E, S, device="cuda")
    for layer in range(L):  # compile outside the capture
        warm.decide(layer, trace[0, layer][None].cuda(), 3, impl="triton")
    ref, dev = ResidencyTable(L, E, S), ResidencyTable(L, E, S, device="cuda")
    ids_in = torch.empty((L, 1, K), dtype=torch.int64, device="cuda")  # [L, T=1, K] static input
    budget = torch.tensor(3, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = [dev.decide(layer, ids_in[layer], budget, impl="triton") for layer in range(L)]
    for step in range(20):
        ids_in.copy_(trace[step][:, None])
        graph.replay()
        for layer in range(L):
            r = ref.decide(layer, trace[step, layer][None], 3)
            for name, a, b in zip(r._fields, r, out[layer]):
                assert a.tolist() == b.cpu().tolist(), f"{step}/{layer}: {name} differs"
    same_tables(ref, dev)
