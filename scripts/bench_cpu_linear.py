"""Decode-size CPU linear: torch's F.linear vs the streaming kernel (kernels.cpu.linear_ops),
beside the host read ceiling measured in the same process. Default shapes: the demo model's
LM head (151936 x 256) and a Qwen3.6-sized one (248320 x 2048) and attention projection.

  python scripts/bench_cpu_linear.py                       # all threads torch would use
  python scripts/bench_cpu_linear.py --shapes 151936x256 --dtypes float32 --rows 1,4
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.experts import bandwidth as bw
from kernels.cpu.ext import cpu_model, load_kernel
from kernels.cpu.linear_ops import small_linear


def _time(fn, seconds: float) -> float:
    for _ in range(2):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="151936x256,248320x2048,4096x2048", help="NxK list")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--seconds", type=float, default=0.5)
    a = p.parse_args()
    kern = load_kernel()
    nth = torch.get_num_threads()
    print(f"[bench] cpu={cpu_model()!r} isa={kern.built_isa if kern else 'torch-only'} "
          f"threads={nth}", flush=True)
    ceiling = bw.host_read_gbps(1e9, repeats=3, threads=nth)
    print(f"ceiling (all-thread read stream): {ceiling:.1f} GB/s")
    print(f"{'N x K':>14} {'dtype':>9} {'T':>3} {'torch ms':>9} {'GB/s':>6} {'kernel ms':>10} "
          f"{'GB/s':>6} {'% ceil':>7} {'x torch':>8}")
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for dt in a.dtypes.split(","):
            w = torch.randn(n, k).to(getattr(torch, dt))
            nbytes = w.numel() * w.element_size()
            for t in (int(v) for v in a.rows.split(",")):
                x = torch.randn(t, k).to(w.dtype)  # the model passes its own dtype
                tt = _time(lambda x=x, w=w: F.linear(x.to(w.dtype), w), a.seconds)
                tk = _time(lambda x=x, w=w: small_linear(x.to(w.dtype), w), a.seconds)
                print(f"{shape:>14} {dt:>9} {t:>3} {tt * 1e3:9.2f} {nbytes / tt / 1e9:6.1f} "
                      f"{tk * 1e3:10.2f} {nbytes / tk / 1e9:6.1f} "
                      f"{100 * nbytes / tk / 1e9 / ceiling:7.1f} {tt / tk:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
