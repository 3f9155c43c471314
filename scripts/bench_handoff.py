"""Per-layer cost of the ways a captured decode step can hand work to the host and take the
answer back (issue 10, item 4), on a CUDA device. A step is L layers; each layer is two GEMVs
of a (work-dim x hidden) bf16 matrix, the layer's GPU work before the hand-off and the GPU's
own share after it, and between them one of:

  none          no hand-off: the baseline
  spin          the bridge's mechanism (experts/cpu_bridge.py): store_rows + raise_flag, the
                GPU's share, wait_flag + merge_rows; the host answers from a native loop
                spinning on the flags (ft_bridge_echo), started for each step from a
                persistent thread. The host's work overlaps the GPU's share.
  hostfunc      a host-function node per layer (cuLaunchHostFunc, captured) in line: the
                stream waits for the callback, the GPU's share runs after it
  hostfunc-par  the host node on a forked branch of the graph, beside the GPU's share, joined
                before the next layer (the best a host node can do: the work overlaps)
  split         graphs per layer: A = merge of the previous answer, the layer's first GEMV,
                store_rows; the host waits for A (stream sync), replays B (the GPU's share),
                answers while B runs, and replays the next A

Every mechanism is captured once; the host's answer busy-waits --host-us microseconds per
layer (0: the bare hand-off; the CPU share's work at real sizes: tens to hundreds of µs).
Prints the median step time of each and (step - none) / L, the cost per layer over no
hand-off, and that cost less the host's work (the mechanism's overhead; below zero where the
host's work hides behind the GPU's share).

  python scripts/bench_handoff.py --layers 20 --steps 300 --host-us 0,30,100
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
    p.add_argument("--host-us", default="0,30,100",
                   help="the host's busy work per layer, µs, comma-separated")
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

    # -- none ---------------------------------------------------------------------------------
    def body_none() -> None:
        for _ in range(L):
            work()
            work()

    g_none = _graph(body_none)
    host_us = [float(v) for v in a.host_us.split(",")]
    steps = {"none": g_none.replay}

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
    steps_q: queue.Queue[tuple[int, float]] = queue.Queue()
    work_now = [0.0]  # the host's work per layer, µs, of the rows being timed

    def answer() -> None:
        while True:
            seq, us = steps_q.get()
            if seq < 0:
                return
            echo_step(kern, go, done, seq, 10.0, threads=1, work_us=us)

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
        steps_q.put((seq[0], work_now[0]))
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
    steps["spin"] = lambda: step_spin(g_spin.replay)

    # -- hostfunc: a host node per layer, in line and on a parallel branch ----------------------
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    libcuda.cuLaunchHostFunc.restype = ctypes.c_int
    fn = host_bump_address(kern)
    harg = (ctypes.c_int64 * 2)(0, 0)  # {callbacks run, work ns}

    def host_node() -> None:
        rc = libcuda.cuLaunchHostFunc(torch.cuda.current_stream().cuda_stream, fn,
                                      ctypes.addressof(harg))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed: CUresult {rc}")

    def body_hostfunc() -> None:
        for _ in range(L):
            work()
            host_node()
            work()

    side = torch.cuda.Stream()

    def body_hostfunc_par() -> None:
        main = torch.cuda.current_stream()
        for _ in range(L):
            work()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                host_node()
            work()
            main.wait_stream(side)

    g_host = _graph(body_hostfunc)
    g_host_par = _graph(body_hostfunc_par)
    steps["hostfunc"] = g_host.replay
    steps["hostfunc-par"] = g_host_par.replay

    # -- split: graphs per layer, the host in between -------------------------------------------
    bump = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)

    def part_a() -> None:
        merge_rows(y, hout[0], need)
        work()
        store_rows(x, ids, need, hx[0], hids[0], hmask[0])

    g_a, g_b = _graph(part_a), _graph(work)
    g_merge = _graph(lambda: merge_rows(y, hout[0], need))

    def step_split() -> None:
        stream = torch.cuda.current_stream()
        for _ in range(L):
            g_a.replay()
            stream.synchronize()  # the host takes the layer's rows
            g_b.replay()
            bump(ctypes.addressof(harg))  # the host's answer, while B runs
        g_merge.replay()

    steps["split"] = step_split

    results: dict[tuple[str, float], float] = {}
    for us in host_us:
        work_now[0] = us
        harg[1] = round(us * 1e3)
        for name, run in steps.items():
            harg[0] = 0
            results[name, us] = _timed(run, a.steps)
            if name.startswith("hostfunc") and harg[0] != L * a.steps:
                raise SystemExit(f"{name}: {harg[0]} callbacks ran, expected {L * a.steps}")
    steps_q.put((-1, 0.0))
    worker.join(timeout=5)
    if int(err[0]) or done.tolist() != [seq[0]] * L:
        raise SystemExit(f"spin: a wait gave up (err={int(err[0])}, done={done.tolist()})")

    base = results["none", host_us[0]]
    print(f"layers={L} hidden={H} work_dim={a.work_dim} steps={a.steps} "
          f"({torch.cuda.get_device_name()}); the GPU's share per layer: one GEMV "
          f"(about {base / (2 * L) * 1e6:.1f} µs)")
    print(f"{'mechanism':13} {'host µs':>8} {'step ms':>9} {'+/layer µs':>11} "
          f"{'overhead µs':>12}")
    for us in host_us:
        for name in steps:
            t = results[name, us]
            if name == "none":
                if us == host_us[0]:
                    print(f"{name:13} {'-':>8} {t * 1e3:9.3f} {'-':>11} {'-':>12}")
                continue
            per = (t - base) / L * 1e6
            print(f"{name:13} {us:8.0f} {t * 1e3:9.3f} {per:11.1f} {per - us:12.1f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
