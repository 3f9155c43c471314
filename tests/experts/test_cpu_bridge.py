"""The CPU bridge's protocol on the CPU device (flags in host tensors): the native step loop
(freetoken/kernels/cpu/bridge_kernel.cpp) against the Python worker it replaces (cpu_branch per
layer) bit for bit, both against the float64 reference, and the failure paths (a layer whose flag
never comes, a bad expert id) surfacing as errors instead of hangs.

Shapes: L layers, T rows, K top-k, H hidden, E experts, I intermediate."""
from __future__ import annotations

import time

import pytest
import torch

from freetoken.experts import bridge as cpu_bridge
from freetoken.experts.bridge import BridgeError, CpuBridge
from freetoken.experts.split import cpu_branch
from freetoken.experts.store import ExpertStore
from freetoken.kernels.cpu.ext import load_kernel
from freetoken.kernels.reference import expert_ffn_reference

L, B, K, H, E, I = 3, 6, 4, 72, 7, 40  # odd H, I: vector tails

needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="C++ CPU kernel unavailable")


def _banks(wdtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gu = [(torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(wdtype) for _ in range(L)]
    dn = [(torch.randn(E, H, I, generator=g) / I**0.5).to(wdtype) for _ in range(L)]
    return gu, dn


def _bridge(gu, dn, io_dtype: torch.dtype, native: bool) -> CpuBridge:
    store = ExpertStore(gu, dn, pin=False)
    return CpuBridge(L, B, K, H, io_dtype, torch.device("cpu"),
                     lambda m, x, ids, mask: cpu_branch(x, ids, mask, store, m, 2),
                     banks=(gu, dn) if native else None, threads=2)


def _step(br: CpuBridge, x, ids, mask) -> torch.Tensor:
    """One decode step driven as the graph drives it: send, (GPU work), receive per layer.
    Returns [L, T, K, H] (rows outside the mask: whatever the buffer held)."""
    T = x.shape[1]
    br.begin_step(T)
    ys = []
    for m in range(L):
        br.send(m, x[m], ids[m], mask[m])
        ys.append(br.receive(m, mask[m], torch.zeros(T, K, H, dtype=x.dtype)).clone())
    br.end_step()
    # the worker counts a step after its last done flag, which receive may see first
    t0 = time.perf_counter()
    while br.steps_done < br.seq and br._failed is None and time.perf_counter() - t0 < 5:
        time.sleep(1e-4)
    return torch.stack(ys)


def _inputs(T: int, io_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, T, H, generator=g).to(io_dtype)  # [L, T, H]
    ids = torch.randint(0, E, (L, T, K), generator=g)  # [L, T, K]
    mask = torch.rand(L, T, K, generator=g) < 0.6  # [L, T, K]
    mask[1] = False  # a layer with no CPU work
    if T >= 4:
        ids[2, :, 0] = 3  # >= 4 rows on one expert: the dpbf16 / tile path for bf16 banks
        mask[2, :, 0] = True
    return x, ids, mask


# (weights, x/out dtype, rows): bf16 banks at any rows; fp32 banks at one row (with several
# rows the Python path uses grouped F.linear, so the native loop is not taken there)
CASES = [(torch.bfloat16, torch.bfloat16, 1), (torch.bfloat16, torch.bfloat16, 3),
         (torch.bfloat16, torch.bfloat16, 6), (torch.bfloat16, torch.float32, 2),
         (torch.float32, torch.float32, 1)]


@needs_kernel
@pytest.mark.parametrize("wdtype,io_dtype,T", CASES)
def test_native_loop_equals_python_worker(wdtype, io_dtype, T) -> None:
    """Bug caught: a step loop whose rows differ from the per-layer kernel call (another dot
    product order, another bf16 rounding of the results, layers mixed up, a stale layer's
    grouping reused) — the native loop must give the Python worker's results bit for bit."""
    gu, dn = _banks(wdtype)
    nat, py = _bridge(gu, dn, io_dtype, True), _bridge(gu, dn, io_dtype, False)
    assert nat.native is not None and py.native is None
    for step in range(2):  # a second step reuses the team and the per-layer scratch
        x, ids, mask = _inputs(T, io_dtype, seed=10 * T + step)
        y_nat, y_py = _step(nat, x, ids, mask), _step(py, x, ids, mask)
        sel = mask[..., None].expand_as(y_nat)
        assert torch.equal(y_nat[sel], y_py[sel])
        for m in range(L):  # and both against the float64 reference
            ref = expert_ffn_reference(x[m].float(), ids[m], gu[m], dn[m], mask[m])
            got = y_nat[m].double() * mask[m][..., None]
            tol = 2e-2 if wdtype == torch.bfloat16 or io_dtype == torch.bfloat16 else 1e-5
            assert float((got - ref).norm()) <= tol * max(float(ref.norm()), 1e-6)
    assert nat.native_steps == 2 and nat.steps_done == 2


@needs_kernel
def test_fp32_banks_with_several_rows_take_the_python_path() -> None:
    """Bug caught: fp32 steps of several rows sent through the C++ loop, whose dot products
    differ from the grouped F.linear that `fused` and the eager CPU branch use (fp32 backends
    must stay bit-identical to fused)."""
    gu, dn = _banks(torch.float32)
    br = _bridge(gu, dn, torch.float32, True)
    _step(br, *_inputs(3, torch.float32, seed=1))
    assert br.steps_done == 1 and br.native_steps == 0
    _step(br, *_inputs(1, torch.float32, seed=2))
    assert br.native_steps == 1


@needs_kernel
def test_native_layer_that_never_arrives_fails_the_step(monkeypatch) -> None:
    """Bug caught: a native loop that waits forever (or returns quietly) when the GPU never
    raises a layer's flag; the step must fail through end_step and the next begin_step."""
    monkeypatch.setattr(cpu_bridge, "WORKER_TIMEOUT_S", 0.3)
    gu, dn = _banks(torch.bfloat16)
    br = _bridge(gu, dn, torch.bfloat16, True)
    x, ids, mask = _inputs(1, torch.bfloat16, seed=3)
    br.begin_step(1, replay=True)  # (a replay: its layers come within the step's GPU time)
    br.send(0, x[0], ids[0], mask[0])
    y = torch.zeros(1, K, H, dtype=torch.bfloat16)
    br.receive(0, mask[0], y)
    # layer 1 never sent: its wait (for CPU work it was given) gives up after the timeout
    br.receive(1, torch.ones(1, K, dtype=torch.bool), y)
    with pytest.raises(BridgeError):
        br.end_step()
    br._thread.join(timeout=5)  # the worker gives up on its own clock and exits
    with pytest.raises(BridgeError, match="never arrived"):
        br.begin_step(1)


@needs_kernel
def test_native_bad_expert_id_fails_the_step(monkeypatch) -> None:
    """Bug caught: an out-of-range expert id read past the banks instead of failing."""
    monkeypatch.setattr(cpu_bridge, "WORKER_TIMEOUT_S", 0.3)
    gu, dn = _banks(torch.bfloat16)
    br = _bridge(gu, dn, torch.bfloat16, True)
    x, ids, mask = _inputs(1, torch.bfloat16, seed=4)
    ids[0, 0, 0], mask[0, 0, 0] = E, True
    br.begin_step(1, replay=True)
    br.send(0, x[0], ids[0], mask[0])
    br.receive(0, mask[0], torch.zeros(1, K, H, dtype=torch.bfloat16))
    with pytest.raises(BridgeError):
        br.end_step()
    br._thread.join(timeout=5)
    with pytest.raises(BridgeError, match="out of range"):
        br.begin_step(1)


@needs_kernel
def test_native_loop_takes_a_later_steps_flag() -> None:
    """The GPU does not wait for layers without CPU work, so it can start step seq+1 (raising
    go[m] = seq+1) before the worker has seen go[m] = seq. Bug caught: a loop that waits for
    go[m] == seq exactly spins until its timeout (a failed step) instead of going on; the
    results it then computes are the later step's (its buffers), done[m] = seq."""
    gu, dn = _banks(torch.bfloat16)
    br = _bridge(gu, dn, torch.bfloat16, True)
    x, ids, mask = _inputs(1, torch.bfloat16, seed=5)
    br.x[:, :1].copy_(x)
    br.ids[:, :1].copy_(ids)
    br.mask[:, :1].copy_(mask)
    br.go.fill_(2)
    st = br.native.run_step(1, 1, 0.5)
    assert st.total_s < 0.4
    assert br.done.tolist() == [1] * L
    for m in range(L):
        ref = expert_ffn_reference(x[m].float(), ids[m], gu[m], dn[m], mask[m])
        got = br.out[m, :1].double() * mask[m][..., None]
        assert float((got - ref).norm()) <= 2e-2 * max(float(ref.norm()), 1e-6)


def test_layer_without_cpu_work_does_not_wait() -> None:
    """receive() of a layer whose CPU mask is empty returns at once, even though the worker
    never answered it (on CUDA the wait kernel skips the same way)."""
    gu, dn = _banks(torch.bfloat16)
    br = _bridge(gu, dn, torch.bfloat16, False)
    br.seq_dev.fill_(7)  # a step the worker was never told about: no done flag will come
    t0 = time.perf_counter()
    y = torch.randn(1, K, H).to(torch.bfloat16)
    assert torch.equal(br.receive(0, torch.zeros(1, K, dtype=torch.bool), y), y)
    assert time.perf_counter() - t0 < 1.0 and int(br.err[0]) == 0


def test_python_worker_without_banks() -> None:
    """The fallback path alone (no banks given, as when the kernel is unavailable) still
    answers every layer with the reference's results."""
    gu, dn = _banks(torch.float32)
    br = _bridge(gu, dn, torch.float32, False)
    x, ids, mask = _inputs(2, torch.float32, seed=5)
    y = _step(br, x, ids, mask)
    for m in range(L):
        ref = expert_ffn_reference(x[m], ids[m], gu[m], dn[m], mask[m])
        got = y[m].double() * mask[m][..., None]
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4)
    assert br.native_steps == 0 and br.steps_done == 1


@pytest.mark.parametrize("native", [True, False])
def test_eager_step_waits_out_a_slow_first_layer(monkeypatch, native: bool) -> None:
    """Issue #20, the cold-start crash: the first eager step through the runner compiles
    kernels (Triton JIT, tens of seconds) before layer 0 sends, and the worker's wall-clock
    timeout killed it (`layer 0 of step 1 never arrived`, then BridgeError from warm-up).
    A layer that comes later than any timeout must still be answered in an eager step."""
    if native and load_kernel() is None:
        pytest.skip("C++ CPU kernel unavailable")
    monkeypatch.setattr(cpu_bridge, "WORKER_TIMEOUT_S", 0.2)
    gu, dn = _banks(torch.bfloat16)
    br = _bridge(gu, dn, torch.bfloat16, native)
    x, ids, mask = _inputs(1, torch.bfloat16, seed=8)
    br.begin_step(1)  # eager (replay=False): the launch may compile
    time.sleep(0.6)  # "JIT" before layer 0's flag: three times the worker's timeout
    y = torch.stack([
        (br.send(m, x[m], ids[m], mask[m]),
         br.receive(m, mask[m], torch.zeros(1, K, H, dtype=torch.bfloat16)).clone())[1]
        for m in range(L)])
    br.end_step()  # no error: the worker waited
    assert not br.failed and int(br.err[0]) == 0
    for m in range(L):
        ref = expert_ffn_reference(x[m].float(), ids[m], gu[m], dn[m], mask[m])
        got = y[m].double() * mask[m][..., None]
        assert float((got - ref).norm()) <= 2e-2 * max(float(ref.norm()), 1e-6)


def test_closed_bridge_stops_its_worker() -> None:
    """A bridge the engine dropped stops its worker thread and begins no further step."""
    gu, dn = _banks(torch.float32)
    br = _bridge(gu, dn, torch.float32, False)
    br.close()
    br._thread.join(timeout=5)
    assert not br._thread.is_alive()
    with pytest.raises(BridgeError, match="closed"):
        br.begin_step(1)


@needs_kernel
def test_steps_begun_ahead_run_in_order() -> None:
    """The decode runner begins step n+1 before step n's tokens are read. Bug caught: a worker
    that reads only the latest step number skips step n (its layers with CPU work then never
    answer) or runs step n with step n+1's row count."""
    gu, dn = _banks(torch.bfloat16)
    br = _bridge(gu, dn, torch.bfloat16, True)
    a, b = _inputs(1, torch.bfloat16, seed=6), _inputs(3, torch.bfloat16, seed=7)
    br.begin_step(1)  # step 1 (one row) and step 2 (three rows) begun before either runs
    br.begin_step(3)
    outs = []
    for x, ids, mask in (a, b):
        T = x.shape[1]
        ys = []
        for m in range(L):
            br.send(m, x[m], ids[m], mask[m])
            ys.append(br.receive(m, mask[m], torch.zeros(T, K, H, dtype=x.dtype)).clone())
        outs.append(torch.stack(ys))
    br.end_step()
    br.end_step()
    assert int(br.err[0]) == 0
    for (x, ids, mask), y in zip((a, b), outs):
        for m in range(L):
            ref = expert_ffn_reference(x[m].float(), ids[m], gu[m], dn[m], mask[m])
            got = y[m].double() * mask[m][..., None]
            assert float((got - ref).norm()) <= 2e-2 * max(float(ref.norm()), 1e-6)


@needs_kernel
def test_echo_answers_the_simulated_gpu_and_host_bump_counts() -> None:
    """The host side of scripts/bench_handoff.py: ft_bridge_echo answers each layer's go flag
    (the GPU's side simulated on another thread) after its simulated work, and the
    host-function callback busy-waits its work, then increments its counter. Bugs caught: an
    echo that answers before the flag (done set ahead of go), never (the simulated GPU times
    out) or without doing its work (the benchmark's host-work rows would measure nothing)."""
    import ctypes
    import threading
    import time

    from freetoken.kernels.cpu.bridge_ops import echo_step, host_bump_address, sim_gpu

    kern = load_kernel()
    go = torch.full((L,), -1, dtype=torch.int64)
    done = torch.full((L,), -1, dtype=torch.int64)
    for seq, work_us in ((1, 0.0), (2, 300.0)):
        t = threading.Thread(target=echo_step, args=(kern, go, done, seq, 5.0),
                             kwargs={"work_us": work_us})
        t.start()
        lat = sim_gpu(kern, go, done, seq, gap_s=1e-5, timeout_s=5.0)
        t.join(timeout=5)
        assert all(v >= work_us * 1e-6 for v in lat) and done.tolist() == [seq] * L
    with pytest.raises(TimeoutError):
        echo_step(kern, go, done, 3, 0.05)  # no go flag for step 3 ever comes
    bump = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(host_bump_address(kern))
    arg = (ctypes.c_int64 * 2)(5, 0)
    bump(ctypes.addressof(arg))
    assert arg[0] == 6
    arg[1] = 2_000_000  # 2 ms of work
    t0 = time.perf_counter()
    bump(ctypes.addressof(arg))
    assert arg[0] == 7 and time.perf_counter() - t0 >= 2e-3


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("sent", [0, 1])
def test_abandoned_step_releases_the_worker(monkeypatch, native: bool, sent: int) -> None:
    """Issue 22: a replayed step that raises after sending `sent` of its layers. Bugs caught:
    the worker left waiting for the unsent layers (it failed at its timeout: `layer 1 of step
    1 never arrived`), the unsent layers computed from stale buffers, or the device's step
    counter left behind the host's (the next step's flags then carry the dead step's number:
    its receive takes the worker's answer to the wrong step, or waits it out). The next step
    — another row count — must get the reference's results, without any wait timing out."""
    if native and load_kernel() is None:
        pytest.skip("C++ CPU kernel unavailable")
    monkeypatch.setattr(cpu_bridge, "WORKER_TIMEOUT_S", 2.0)
    gu, dn = _banks(torch.bfloat16)
    br = _bridge(gu, dn, torch.bfloat16, native)
    x, ids, mask = _inputs(1, torch.bfloat16, seed=9)
    br.out.fill_(7.0)  # a layer the worker computes writes over its masked entries
    br.mask.fill_(True)  # stale buffers from earlier steps (expert 0, zero rows)
    br.begin_step(1, replay=True)
    for m in range(sent):
        br.send(m, x[m], ids[m], mask[m])
        br.receive(m, mask[m], torch.zeros(1, K, H, dtype=torch.bfloat16))
    t0 = time.perf_counter()
    br.abandon()
    assert time.perf_counter() - t0 < 1.0  # released, not timed out
    assert br.last_run == br.seq == int(br.seq_dev) == 1 and br.abandoned == 1
    assert not br.failed and int(br.err[0]) == 0
    assert bool((br.out[sent:] == 7.0).all())  # the unsent layers computed nothing
    x2, ids2, mask2 = _inputs(3, torch.bfloat16, seed=10)
    y = _step(br, x2, ids2, mask2)
    assert not br.failed and br.last_run == 2 and br.steps_done == 2
    for m in range(L):
        ref = expert_ffn_reference(x2[m].float(), ids2[m], gu[m], dn[m], mask2[m])
        got = y[m].double() * mask2[m][..., None]
        assert float((got - ref).norm()) <= 2e-2 * max(float(ref.norm()), 1e-6)


def test_abandon_on_a_failed_worker_raises() -> None:
    """A worker that already failed cannot be released: abandon says so (BridgeError, the
    engine then drops the bridge) instead of waiting."""
    gu, dn = _banks(torch.float32)
    br = _bridge(gu, dn, torch.float32, False)
    br.compute = lambda *a: (_ for _ in ()).throw(RuntimeError("injected worker failure"))
    x, ids, mask = _inputs(1, torch.float32, seed=11)
    mask[0] = True
    br.begin_step(1, replay=True)
    br.send(0, x[0], ids[0], mask[0])
    br.receive(0, mask[0], torch.zeros(1, K, H))
    with pytest.raises(BridgeError, match="injected worker failure"):
        br.abandon()
