"""B_H from the bridge's native step loop (freetoken/kernels/cpu/bridge_kernel.cpp -> CpuBridge ->
bw_track.native_sampler -> Reprofiler): the C++ loop reports the experts it computed and its
busy time per step, and the split follows a simulated drop in host bandwidth on that path
(`NativeBridge.set_throttle`: a known extra busy time per expert). Oracles: the distinct
experts per layer counted from the step's inputs in Python; the bandwidth the throttle allows
at most (bytes of one expert / its extra time); `cost_model.q_star` at the measured figures.

Bug it catches: the native loop (taken for every bf16 step, and every one-row fp32 step, on a
machine with the C++ kernel) feeding no B_H samples, so q* never followed the host on the path
that serves decode (#24 item 5)."""
from __future__ import annotations

import time

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.experts import split
from freetoken.experts.bridge import CpuBridge
from freetoken.experts.bw_track import Reprofiler, native_sampler
from freetoken.experts.cost_model import q_star
from freetoken.experts.split import QStarRule, cpu_branch
from freetoken.experts.store import ExpertStore
from freetoken.kernels.cpu.ext import load_kernel
from freetoken.types.config import MoEConfig
from tests.engine.test_engine_core import _prompt, _req, _run

needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="C++ CPU kernel unavailable")

L, B, K, H, E, I = 3, 4, 4, 64, 8, 48


class _Stats:
    reprofiler = None


class _Layer:  # what Reprofiler._refresh_tables reads of a CpuSplitExperts
    store = type("S", (), {"num_experts": 8})()

    def __init__(self, rule):
        self.rule = rule
        self._fetch_table = torch.tensor(rule.table(8))


def _drive(br: CpuBridge, steps: int, seed: int) -> list[int]:
    """`steps` decode steps as the graph drives them (send, receive per layer); returns the
    distinct experts each step's CPU share holds, counted here from the inputs."""
    g = torch.Generator().manual_seed(seed)
    want = []
    for _ in range(steps):
        x = torch.randn(L, B, H, generator=g).to(torch.bfloat16)  # [L, B, H]
        ids = torch.randint(0, E, (L, B, K), generator=g)  # [L, B, K]
        mask = torch.rand(L, B, K, generator=g) < 0.7  # [L, B, K]
        want.append(sum(int(ids[m][mask[m]].unique().numel()) for m in range(L)))
        br.begin_step(B)
        for m in range(L):
            br.send(m, x[m], ids[m], mask[m])
            br.receive(m, mask[m], torch.zeros(B, K, H, dtype=torch.bfloat16))
        br.end_step()
        t0 = time.perf_counter()
        while br.steps_done < br.seq and time.perf_counter() - t0 < 5:
            time.sleep(1e-4)
    return want


@needs_kernel
def test_split_follows_a_host_bandwidth_drop_on_the_native_loop() -> None:
    g = torch.Generator().manual_seed(0)
    gu = [(torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16) for _ in range(L)]
    dn = [(torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16) for _ in range(L)]
    store = ExpertStore(gu, dn, pin=False)
    stats = _Stats()
    got: list[tuple[int, float]] = []

    def sample(n: int, s: float) -> None:
        got.append((n, s))
        native_sampler(stats, store.expert_bytes)(n, s)

    python_calls: list[int] = []

    def compute(m, x, ids, mask):  # the Python path: must not be the one taken
        python_calls.append(m)
        return cpu_branch(x, ids, mask, store, m, 1)

    br = CpuBridge(L, B, K, H, torch.bfloat16, torch.device("cpu"), compute, banks=(gu, dn),
                   threads=1, sample=sample)
    assert br.native is not None
    # the profile's figures: the host reads fast (B_H = 4 x B_P): q*(8) = 2 fetches
    rule = QStarRule(1.0, 4.0, overlap=False)
    layer = _Layer(rule)
    table = layer._fetch_table
    rp = Reprofiler(rule, [layer], every_steps=5, drift=0.0, min_bytes=0)
    stats.reprofiler = rp
    want = _drive(br, 10, seed=1)
    assert br.native_steps == 10 and not python_calls
    assert [n for n, _ in got] == [n for n in want if n]  # the loop's count = the inputs'
    assert all(s > 0 for _, s in got)
    fast = [n * store.expert_bytes / s / 1e9 for n, s in got]
    # simulated drop: 2 ms more per expert, so B_H <= expert_bytes / 2 ms (~0.018 GB/s here),
    # far under what the loop measured unthrottled and under B_P: q* then fetches all 8
    throttle_s = 2e-3
    ceiling = store.expert_bytes / throttle_s / 1e9
    assert min(fast) > 3 * ceiling
    br.native.set_throttle(int(throttle_s * 1e9))
    n_before = len(got)
    _drive(br, 30, seed=2)
    slow = [n * store.expert_bytes / s / 1e9 for n, s in got[n_before:]]
    assert slow and max(slow) <= ceiling * 1.01
    rp.fold()
    assert rp.b_h.taken + rp.b_h.rejected == len(got)  # every native step was a sample
    assert rule.b_h == rp.b_h.gbps < 2 * ceiling  # the estimate followed the drop
    assert rule(8) == q_star(8, rule.b_p, rule.b_h) == 8 > q_star(8, 1.0, 4.0)
    assert layer._fetch_table is table and table.tolist() == rule.table(8)
    br.close()


@needs_kernel
def test_engine_decode_through_the_native_loop_samples_b_h(tiny_hf, monkeypatch) -> None:
    """A hybrid engine decoding one row through the CPU decode runner: the bridge's native
    loop computes the CPU share (fp32 banks, one row), and the re-profiler's B_H samples come
    from it, not from the Python branch, which never runs."""
    model, rt = load_with_experts(tiny_hf("qwen3_5_moe"),
                                  MoEConfig(backend="hybrid", cache_size=6, hybrid_max_fetch=1),
                                  dtype=torch.float32, progress=False)
    core = EngineCore(model, [], kv_tokens=400, state_slots=6, max_running=1, chunk_tokens=32,
                      decode_runner=True, moe=rt)
    rp = rt.enable_reprofile(every_steps=4, drift=0.0, min_bytes=0)
    br = core.runner.bridge
    assert rp is not None and br is not None and br.native is not None
    python_calls: list[int] = []
    real = br.compute
    monkeypatch.setattr(br, "compute", lambda *a: python_calls.append(1) or real(*a))
    assert br.sample is not None  # the runtime wires the loop to the re-profiler
    native: list[int] = []
    sample = br.sample
    monkeypatch.setattr(br, "sample", lambda n, s: native.append(n) or sample(n, s))
    # (prefill's eager steps sample through split's synced path: counted apart)
    eager: list[int] = []
    real_share = split.CpuSplitExperts._cpu_share
    monkeypatch.setattr(split.CpuSplitExperts, "_cpu_share",
                        lambda self, *a: eager.append(1) or real_share(self, *a))
    before = rp.b_h.taken + rp.b_h.rejected
    _run(core, [_req("n", _prompt(model.cfg.vocab_size, 20, 3), 12)])
    rp.fold()
    assert br.native_steps > 0 and not python_calls and len(native) >= 1
    assert rp.b_h.taken + rp.b_h.rejected - before == len(native) + len(eager)
    assert rt.q_rule.b_h == rp.b_h.gbps
