"""Per-layer cost of the ways a captured decode step can hand work to the host and take the
answer back (issue 10, item 4), on a CUDA device. A step is L layers, each two GEMVs of a
(work-dim x hidden) bf16 matrix (a layer's GPU work before and after the hand-off), and between
them one of:

  none      no hand-off: the baseline
  spin      the bridge's mechanism (experts/cpu_bridge.py): store_rows + raise_flag, the GEMV,
            wait_flag + merge_rows; the host answers from a native loop spinning on the flags
            (ft_bridge_echo), started for each step from a persistent thread
  hostfunc  a host-function node per layer (cuLaunchHostFunc, captured into the graph) running
            a C callback; the stream waits for it to return
  split     one graph per layer: the host waits for it (stream sync), answers, replays the next

`none`, `spin` and `hostfunc` are captured as one graph per step. Prints the median step time
of each and (step - none) / L, the mechanism's cost per layer. The host answers with no work,
so this is the bare hand-off; what the CPU computes comes on top in every mechanism.

  python scripts/bench_handoff.py --layers 20 --steps 300
"""
from __future__ import annotations

import argparse
import ctypes
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.cpu.bridge_ops import echo_step, host_bump_address
from kernels.cpu.ext import load_kernel


def _timed(run, steps: int) -> float:
    """Median seconds of `run()` (one step, synchronised at its end) over `steps` runs."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graph(body) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()
    return g


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--work-dim", type=int, default=4096, help="rows of each layer's GEMVs")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_handoff measures a GPU's hand-off to the host: it needs CUDA")
    kern = load_kernel()
    if kern is None:
        raise SystemExit("the C++ CPU kernel did not build: the host side of `spin` needs it")
    from kernels.triton.host_flags import merge_rows, raise_flag, store_rows, wait_flag

    L, H, K, dev = a.layers, a.hidden, a.top_k, "cuda"
    bf = torch.bfloat16
    w = torch.randn(a.work_dim, H, dtype=bf, device=dev) * H ** -0.5
    x = torch.randn(1, H, dtype=bf, device=dev)
    sink = torch.zeros(1, a.work_dim, dtype=bf, device=dev)

    def work() -> None:
        torch.mm(x, w.t(), out=sink)

    # -- none -------------------------------------------------------------------------------
    def body_none() -> None:
        for _ in range(L):
            work()
            work()

    g_none = _graph(body_none)
    results = {"none": _timed(g_none.replay, a.steps)}

    # -- spin: the bridge's kernels and a native host loop answering the flags ---------------
    pin = {"pin_memory": True}
    hx = torch.zeros(L, 1, H, dtype=bf, **pin)
    hids = torch.zeros(L, 1, K, dtype=torch.int64, **pin)
    hmask = torch.zeros(L, 1, K, dtype=torch.bool, **pin)
    hout = torch.zeros(L, 1, K, H, dtype=bf, **pin)
    go = torch.full((L,), -1, dtype=torch.int64, **pin)
    done = torch.full((L,), -1, dtype=torch.int64, **pin)
    err = torch.zeros(1, dtype=torch.int32, **pin)
    seq_dev = torch.zeros(1, dtype=torch.int64, device=dev)
    ids = torch.zeros(1, K, dtype=torch.int64, device=dev)
    need = torch.ones(1, K, dtype=torch.bool, device=dev)  # every layer waits for its answer
    y = torch.zeros(1, K, H, dtype=bf, device=dev)
    steps_q: queue.Queue[int] = queue.Queue()

    def answer() -> None:
        while True:
            seq = steps_q.get()
            if seq < 0:
                return
            echo_step(kern, go, done, seq, 10.0, threads=1)

    worker = threading.Thread(target=answer, daemon=True)
    worker.start()
    seq = [0]

    def body_spin() -> None:
        seq_dev.add_(1)
        for m in range(L):
            work()
            store_rows(x, ids, need, hx[m], hids[m], hmask[m])
            raise_flag(go, m, seq_dev)
            work()
            wait_flag(done, m, seq_dev, err, need=need)
            merge_rows(y, hout[m], need)

    def step_spin(run) -> None:
        seq[0] += 1
        steps_q.put(seq[0])
        run()

    # warm-up and capture (the capture's own pass is not executed: no step number for it)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step_spin(body_spin)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g_spin = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_spin):
        body_spin()
    results["spin"] = _timed(lambda: step_spin(g_spin.replay), a.steps)
    steps_q.put(-1)
    worker.join(timeout=5)
    if int(err[0]) or done.tolist() != [seq[0]] * L:
        raise SystemExit(f"spin: a wait gave up (err={int(err[0])}, done={done.tolist()})")

    # -- hostfunc: a host node per layer --------------------------------------------------------
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    libcuda.cuLaunchHostFunc.restype = ctypes.c_int
    fn = host_bump_address(kern)
    counter = ctypes.c_int64(0)

    def body_hostfunc() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        for _ in range(L):
            work()
            rc = libcuda.cuLaunchHostFunc(stream, fn, ctypes.addressof(counter))
            if rc != 0:
                raise RuntimeError(f"cuLaunchHostFunc failed: CUresult {rc}")
            work()

    g_host = _graph(body_hostfunc)
    counter.value = 0
    results["hostfunc"] = _timed(g_host.replay, a.steps)
    if counter.value != L * a.steps:
        raise SystemExit(f"hostfunc: {counter.value} callbacks ran, expected {L * a.steps}")

    # -- split: one graph per layer, the host in between ----------------------------------------
    g_layer = _graph(lambda: (work(), work()))

    def step_split() -> None:
        for _ in range(L):
            g_layer.replay()
            torch.cuda.current_stream().synchronize()  # the host takes the layer's result

    results["split"] = _timed(step_split, a.steps)

    base = results["none"]
    print(f"layers={L} hidden={H} work_dim={a.work_dim} steps={a.steps} "
          f"({torch.cuda.get_device_name()})")
    print(f"{'mechanism':10} {'step ms':>9} {'per layer µs':>13}")
    for name, t in results.items():
        per = "-" if name == "none" else f"{(t - base) / L * 1e6:13.1f}"
        print(f"{name:10} {t * 1e3:9.3f} {per:>13}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
