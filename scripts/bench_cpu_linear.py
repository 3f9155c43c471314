"""Decode-size CPU linear: torch's F.linear vs the streaming kernel
(freetoken.kernels.cpu.linear_ops),
beside the host read ceiling measured in the same process. Default shapes: the demo model's
LM head (151936 x 256) and a Qwen3.6-sized one (248320 x 2048) and attention projection.

  python scripts/bench_cpu_linear.py                       # all threads torch would use
  python scripts/bench_cpu_linear.py --shapes 151936x256 --dtypes float32 --rows 1,4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.bench import bandwidth as bw
from freetoken.kernels.cpu.linear_ops import small_linear


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="151936x256,248320x2048,4096x2048", help="NxK list")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--seconds", type=float, default=0.5)
    a = p.parse_args()
    _, ceiling = bw.bench_banner("")
    print(f"{'N x K':>14} {'dtype':>9} {'T':>3} {'torch ms':>9} {'GB/s':>6} {'kernel ms':>10} "
          f"{'GB/s':>6} {'% ceil':>7} {'x torch':>8}")
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for dt in a.dtypes.split(","):
            w = torch.randn(n, k).to(getattr(torch, dt))
            nbytes = w.numel() * w.element_size()
            for t in (int(v) for v in a.rows.split(",")):
                x = torch.randn(t, k).to(w.dtype)  # the model passes its own dtype
                tt = bw.time_call(lambda x=x, w=w: F.linear(x.to(w.dtype), w), a.seconds)
                tk = bw.time_call(lambda x=x, w=w: small_linear(x.to(w.dtype), w), a.seconds)
                print(f"{shape:>14} {dt:>9} {t:>3} {tt * 1e3:9.2f} {nbytes / tt / 1e9:6.1f} "
                      f"{tk * 1e3:10.2f} {nbytes / tk / 1e9:6.1f} "
                      f"{100 * nbytes / tk / 1e9 / ceiling:7.1f} {tt / tk:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
