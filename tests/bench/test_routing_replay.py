"""Routing traces (format, loader, synthetic, calibration) and the replay policies."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from freetoken.bench import cli_routing as cli_bench
from freetoken.bench.replay import FastLru, lru_miss_rate, replay
from freetoken.bench.routing import (
    CALIBRATION_CAPACITY,
    CALIBRATION_STEPS,
    CALIBRATION_TARGET_MISS,
    CALIBRATION_WARMUP,
    QWEN36_SHAPE,
    SYNTH_LOCALITY_QWEN36,
    synthetic_routing,
    synthetic_trace,
)
from freetoken.bench.routing_trace import (
    RoutingRecorder,
    RoutingTrace,
    load_trace,
)
from freetoken.envs import routing_traces_dir
from freetoken.experts.residency import ResidencyTable
from tests.experts.lru_model import LruModel


def test_recorder_round_trip(tmp_path) -> None:
    rng = np.random.default_rng(0)
    rec = RoutingRecorder(num_layers=3, num_experts=8, top_k=2)
    dec = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)])
                    for _ in range(5)])  # [5, 3, 2]
    pre = rng.integers(0, 8, size=(3, 4, 2))  # [L, T, K]
    for layer in range(3):
        rec.record_prefill(layer, torch.from_numpy(pre[layer, :3]))
        rec.record_prefill(layer, pre[layer, 3:])  # chunks concatenate
    for step in dec:
        for layer, ids in enumerate(step):
            rec.record(layer, torch.from_numpy(ids)[None])
    rec.save(tmp_path / "t.npz")
    tr = load_trace(tmp_path / "t.npz")
    assert tr.decode.dtype == np.uint8 and tr.decode.shape == (1, 5, 3, 2)
    assert (tr.decode[0] == dec).all() and (tr.prefill[0] == pre).all()
    assert (tr.num_experts, tr.top_k) == (8, 2)
    with pytest.raises(ValueError):
        rec.record(0, np.array([8, 1]))


def test_shared_trace_loads_sequence_major() -> None:
    tr = load_trace("shared")
    raw = np.load(routing_traces_dir() / "decode_routing.npy")  # [steps, L, N, K]
    assert tr.decode.shape == (24, 511, 8, 8) and tr.prefill.shape == (24, 8, 256, 8)
    assert (tr.decode[3, 10, 2] == raw[10, 2, 3]).all() and tr.num_experts == 256


def test_synthetic_trace_locality() -> None:
    def overlap(tr: np.ndarray) -> float:
        a, b = tr[1:], tr[:-1]  # [steps-1, L, K]
        return float((a[..., :, None] == b[..., None, :]).any(-1).mean())

    for loc in (0.0, 0.5, 1.0):
        tr = synthetic_trace(3, 64, 4, 400, loc, seed=1)
        assert tr.shape == (400, 3, 4) and tr.min() >= 0 and tr.max() < 64
        assert all(len(set(row)) == 4 for row in tr.reshape(-1, 4).tolist())
        # kept with probability loc, plus the chance that a fresh draw repeats an old expert
        assert loc <= overlap(tr) <= loc + 0.25 * (1 - loc) + 0.03
    frozen = np.sort(synthetic_trace(2, 16, 2, 5, 1.0, 0), axis=2)  # locality 1 never changes
    assert (frozen == frozen[0]).all()


def test_calibrated_locality_gives_paper_miss_rate() -> None:
    layers, experts, k = QWEN36_SHAPE
    slots = round(CALIBRATION_CAPACITY * layers * experts)

    def miss(loc: float, seed: int, steps: int = CALIBRATION_STEPS) -> float:
        tr = synthetic_trace(layers, experts, k, steps, loc, seed)
        return lru_miss_rate(tr, experts, slots, CALIBRATION_WARMUP)

    for seed in (0, 1):
        assert abs(miss(SYNTH_LOCALITY_QWEN36, seed) - CALIBRATION_TARGET_MISS) < 0.01
    half = CALIBRATION_STEPS // 2
    assert miss(SYNTH_LOCALITY_QWEN36 - 0.1, 0, half) > CALIBRATION_TARGET_MISS + 0.02
    assert miss(SYNTH_LOCALITY_QWEN36 + 0.1, 0, half) < CALIBRATION_TARGET_MISS - 0.02


def small_trace() -> RoutingTrace:
    tr = load_trace("shared")  # two sequences, 12 prompt tokens, 25 decode steps
    return RoutingTrace(tr.decode[:2, :25], tr.prefill[:2, :, :12], 256, 8)


@pytest.mark.parametrize("slots", [3, 40, 300])
def test_fast_lru_equals_reference_decide(slots: int) -> None:
    tr = small_trace()
    assert replay(tr, "lru", slots, "fast") == replay(tr, "lru", slots, "reference")
    # and the final residency (slots and recency order) is the same
    dec, pre = tr.decode[0], tr.prefill[0]
    sim, table = FastLru(256, slots), ResidencyTable(8, 256, slots)
    for t in range(pre.shape[1]):
        for layer in range(8):
            sim.step(layer, pre[layer, t].tolist())
            table.decide(layer, torch.from_numpy(pre[layer, t].astype(np.int64))[None])
    for step in dec:
        for layer, ids in enumerate(step):
            assert sim.step(layer, ids.tolist()) == tuple(
                table.decide(layer, torch.from_numpy(ids.astype(np.int64))[None]).counters[:2]
                .tolist())
    owner, last = table.slot_owner.tolist(), table.slot_last_use.tolist()
    order = sorted((s for s in range(slots) if owner[s] >= 0), key=lambda s: (last[s], s))
    assert [(owner[s], s) for s in order] == list(sim.lru.items())


def test_static_policies_against_plain_loops() -> None:
    rng = np.random.default_rng(4)
    L, E, K, steps, T = 3, 8, 2, 30, 10
    dec = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)])
                    for _ in range(steps)])  # [steps, L, K]
    pre = rng.integers(0, E, size=(L, T, K))  # [L, T, K]
    tr = RoutingTrace(dec[None], pre[None], E, K)
    for slots in (0, 5, 8, 13, 24):
        share = [slots // L + (layer < slots % L) for layer in range(L)]
        hot = []
        for layer in range(L):
            cnt = [int((pre[layer] == e).sum()) for e in range(E)]
            hot.append(set(sorted(range(E), key=lambda e: (-cnt[e], e))[: share[layer]]))
        whole = slots // E
        pinned_layers = set(range(L - whole, L))
        n = steps * L * K
        hot_miss = sum(e not in hot[layer] for s in dec for layer, r in enumerate(s) for e in r)
        stat_miss = sum(layer not in pinned_layers for s in dec for layer, r in enumerate(s)
                        for _ in r)
        assert replay(tr, "prefill_hot", slots) == pytest.approx(hot_miss / n)
        assert replay(tr, "static_layers", slots) == pytest.approx(stat_miss / n)
    assert replay(tr, "prefill_hot", L * E) == 0.0 == replay(tr, "static_layers", L * E)


def _lru_model_miss_rate(decode: np.ndarray, prefill: np.ndarray, E: int, slots: int) -> float:
    """The oracle: the OrderedDict LRU model, seeded token by token with the prompt, then the
    decode steps counted (each distinct expert of a layer's step once)."""
    lru = LruModel(E, slots)
    for t in range(prefill.shape[1]):
        for layer in range(prefill.shape[0]):
            lru.step(layer, [prefill[layer, t].tolist()], -1)
    misses = total = 0
    for step in decode:
        for layer, ids in enumerate(step):
            _, _, _, (h, m, _) = lru.step(layer, [ids.tolist()], -1)
            misses, total = misses + m, total + h + m
    return misses / total


def test_cli_json(tmp_path, capsys) -> None:
    """`ft bench routing --json` on a recorded file: LRU miss rates equal an independent LRU
    model's, a full-capacity static split never misses, `uniform` is 1 - capacity."""
    tr = synthetic_routing(2, 8, 2, 20, 0.5, prompt_tokens=5)
    rec = RoutingRecorder(2, 8, 2)
    for layer in range(2):
        rec.record_prefill(layer, tr.prefill[0, layer])
    for step in tr.decode[0]:
        for layer, ids in enumerate(step):
            rec.record(layer, ids)
    rec.save(tmp_path / "s.npz")
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    args = parser.parse_args(["routing", "--trace", str(tmp_path / "s.npz"),
                              "--capacities", "0.25,0.5,1.0", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["slots"] for r in out["rows"]] == [4, 8, 16]
    assert [r["uniform"] for r in out["rows"]] == [0.75, 0.5, 0.0]
    assert out["rows"][2]["static_layers"] == 0.0
    for row in out["rows"]:
        want = _lru_model_miss_rate(tr.decode[0], tr.prefill[0], 8, row["slots"])
        assert row["lru"] == pytest.approx(want, abs=1e-12)
    assert out["rows"][0]["lru"] > out["rows"][1]["lru"]  # the trace is not degenerate
