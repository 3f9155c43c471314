"""Decode attention at long context on the CPU: the torch path (gather K/V out of the paged
pool, then SDPA) vs the in-place kernel (freetoken.kernels.cpu.attention_ops), each with the bytes
it must read over the host read ceiling measured in the same process. Default heads: the demo's
full-attention layers (4 query / 2 KV heads x 64); Qwen3.6's are 16 / 2 x 256.

  python scripts/bench_cpu_attention.py --lengths 4096,32768,57344
  python scripts/bench_cpu_attention.py --heads 16,2,256 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.bench import bandwidth as bw
from freetoken.kernels.cpu.attention_ops import cpu_decode_attention


def _measure(L: int, hq: int, hk: int, d: int, dtype: torch.dtype, seconds: float,
             g: torch.Generator) -> tuple[int, float, float]:
    """(K+V bytes, torch seconds, kernel seconds) for one decode row over L pool rows."""
    S = L + L // 4
    k_pool = torch.randn(S, hk, d, generator=g).to(dtype)  # [S, Hk, D]
    v_pool = torch.randn(S, hk, d, generator=g).to(dtype)
    slots = torch.randperm(S, generator=g)[:L].sort().values  # mostly ascending, with gaps
    q = torch.randn(hq, d, generator=g).to(dtype)  # [Hq, D]

    def torch_path() -> torch.Tensor:  # what Attention._attend does for a decode row
        k, v = k_pool[slots], v_pool[slots]  # [L, Hk, D] gathered copies
        return F.scaled_dot_product_attention(
            q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            scale=d**-0.5, enable_gqa=hq != hk)

    tt = bw.time_call(torch_path, seconds)
    tk = bw.time_call(lambda: cpu_decode_attention(q, k_pool, v_pool, slots, d**-0.5), seconds)
    return 2 * L * hk * d * k_pool.element_size(), tt, tk


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="1024,8192,57344")
    p.add_argument("--heads", default="4,2,64", help="Hq,Hk,D")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seconds", type=float, default=0.5)
    a = p.parse_args()
    hq, hk, d = (int(v) for v in a.heads.split(","))
    dtype = getattr(torch, a.dtype)
    _, ceiling = bw.bench_banner(f"heads={hq}/{hk}x{d} dtype={a.dtype}")
    print(f"{'keys':>7} {'K+V MB':>7} {'floor ms':>9} {'torch ms':>9} {'kernel ms':>10} "
          f"{'kernel GB/s':>12} {'% ceil':>7} {'x torch':>8}")
    g = torch.Generator().manual_seed(0)
    for L in (int(v) for v in a.lengths.split(",")):
        nbytes, tt, tk = _measure(L, hq, hk, d, dtype, a.seconds, g)
        floor = nbytes / (ceiling * 1e9)
        print(f"{L:>7} {nbytes / 1e6:7.1f} {floor * 1e3:9.2f} {tt * 1e3:9.2f} {tk * 1e3:10.2f} "
              f"{nbytes / tk / 1e9:12.1f} {100 * floor / tk:7.1f} {tt / tk:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
