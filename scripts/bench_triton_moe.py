"""Benchmark the Triton fused MoE (kernels/triton/fused_moe.py) against torch, on the GPU.

Qwen3.6-35B-A3B shape by default: H=2048, I=512, E=256, top-8, bf16. Prints per case the time
per MoE layer, the weight bytes of the distinct experts the call must read, the achieved GB/s
and the floor (bytes / HBM bandwidth), beside torch's baseline in the same process:
`gathered_experts` (gather + bmm) for decode, `dispatch_experts` (a loop over experts) for the
prefill. Decode calls cycle over --layers copies of the banks with fresh routing each call, so
the L2 (50 MB, one layer's 8 experts) cannot serve a call from the previous one.

    python scripts/bench_triton_moe.py [--tokens 1,4,16] [--prefill 4096] [--sweep]

--sweep times a grid of decode tiles (gate_up, then down) at T=1 and T=4 and prints the best,
for DECODE_CONFIG in kernels/triton/fused_moe.py.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from freetoken.layers.moe import dispatch_experts, gathered_experts
from kernels.triton.fused_moe import DECODE_CONFIG, fused_moe, fused_moe_decode
from kernels.triton.router import fused_router

HBM = 4.0e12  # B/s, the H200's practical HBM3e read rate (4.8 TB/s peak)
BF16_FLOPS = 989e12  # dense bf16 tensor-core peak of the H200 (SXM)


def time_graph(calls, rounds: int = 5) -> float:
    """Seconds per call: all `calls` captured in one CUDA graph, best of `rounds` replays."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / len(calls))
    return best


def time_eager(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def route(T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=-1).indices  # [T, K]


def expert_bytes(ids: torch.Tensor, H: int, I: int, elt: int) -> int:
    return int(ids.unique().numel()) * 3 * H * I * elt


def row(name: str, secs: float, nbytes: int, floor_s: float) -> None:
    print(f"  {name:<34} {secs * 1e6:9.1f} us  {nbytes / secs / 1e9:8.0f} GB/s"
          f"  floor {floor_s * 1e6:7.1f} us  ({floor_s / secs:5.1%} of floor speed)")


def decode_case(T, banks, args, gen):
    H, I, E, K = args.hidden, args.inter, args.experts, args.top_k
    calls_t, calls_g, calls_b, bytes_total = [], [], [], 0
    for layer, (gu, dn) in enumerate(banks * args.repeat):
        x = torch.randn(T, H, device="cuda", dtype=gu.dtype)
        ids = route(T, E, K, gen)
        y = torch.empty(T, K, H, device="cuda", dtype=gu.dtype)
        bytes_total += expert_bytes(ids, H, I, gu.element_size())
        calls_t.append(lambda x=x, ids=ids, gu=gu, dn=dn, y=y: fused_moe(x, ids, gu, dn, y,
                                                                        decode=True))
        calls_g.append(lambda x=x, ids=ids, gu=gu, dn=dn, y=y: fused_moe(x, ids, gu, dn, y,
                                                                        decode=False))
        calls_b.append(lambda x=x, ids=ids, gu=gu, dn=dn, y=y: gathered_experts(x, ids, gu, dn, y))
    nbytes = bytes_total // len(calls_t)
    print(f"T={T} decode ({T * K} entries, {nbytes / 1e6:.1f} MB of distinct experts per layer)")
    # the grouped path last: if its capture fails, the stream is left to recover eagerly
    for name, calls in (("triton decode path", calls_t), ("torch gathered_experts", calls_b),
                        ("triton grouped path", calls_g)):
        try:
            row(name + " (graph)", time_graph(calls), nbytes, nbytes / HBM)
        except Exception as exc:  # noqa: BLE001  (any capture failure is reported, then eager)
            print(f"  {name} cannot be captured: {type(exc).__name__}: {str(exc)[:160]}")
            torch.cuda.synchronize()
            eager = time_eager(lambda calls=calls: [c() for c in calls]) / len(calls)
            row(name + " (eager)", eager, nbytes, nbytes / HBM)


def prefill_case(T, banks, args, gen):
    H, I, E, K = args.hidden, args.inter, args.experts, args.top_k
    gu, dn = banks[0]
    x = torch.randn(T, H, device="cuda", dtype=gu.dtype)
    ids = route(T, E, K, gen)
    y = torch.empty(T, K, H, device="cuda", dtype=gu.dtype)
    nbytes = expert_bytes(ids, H, I, gu.element_size())
    flops = 2 * T * K * 3 * H * I
    floor_s = max(nbytes / HBM, flops / BF16_FLOPS)
    print(f"T={T} prefill ({nbytes / 1e6:.0f} MB of experts, {flops / 1e9:.0f} GFLOP; floor is "
          f"max(bytes / {HBM / 1e12:.1f} TB/s, flops / {BF16_FLOPS / 1e12:.0f} TFLOP/s))")
    t = time_eager(lambda: fused_moe(x, ids, gu, dn, y, decode=False))
    row("triton grouped path (eager)", t, nbytes, floor_s)
    print(f"  {'':<34} {flops / t / 1e12:9.1f} TFLOP/s")
    t = time_eager(lambda: dispatch_experts(x, ids, gu, dn, y), reps=2)
    row("torch dispatch_experts (eager)", t, nbytes, floor_s)


def router_case(args, gen):
    from freetoken.layers.moe import Router

    H, E, K = args.hidden, args.experts, args.top_k
    r = Router(H, E, K, True).cuda().to(torch.bfloat16).requires_grad_(False)
    r.weight.copy_(torch.randn(E, H, device="cuda", generator=gen) / H**0.5)
    for T in (1, 4096):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        tt = time_graph([lambda x=x: fused_router(x, r.weight, K, True)] * 20)
        tr = time_graph([lambda x=x: r(x)] * 20)
        print(f"router T={T}: fused_router {tt * 1e6:.1f} us, Router.forward {tr * 1e6:.1f} us")


def sweep(banks, args, gen):
    H, E, K = args.hidden, args.experts, args.top_k
    dtype = banks[0][0].dtype

    def timed(T, cfg):
        calls = []
        for gu, dn in banks * args.repeat:
            x = torch.randn(T, H, device="cuda", dtype=dtype)
            ids, y = route(T, E, K, gen), torch.empty(T, K, H, device="cuda", dtype=dtype)
            calls.append(lambda x=x, ids=ids, gu=gu, dn=dn, y=y:
                         fused_moe_decode(x, ids, gu, dn, y, config=cfg))
        return time_graph(calls, rounds=3)

    best = {k: dict(v) for k, v in DECODE_CONFIG.items()}
    for part, bns, bks in (("gate_up", (8, 16, 32), (128, 256, 512)),
                           ("down", (16, 32, 64), (64, 128, 256))):
        results = []
        for bn, bk, warps in itertools.product(bns, bks, (2, 4, 8)):
            cfg = {**best, part: {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}}
            ts = [timed(T, cfg) for T in (1, 4)]
            results.append((sum(ts), ts, cfg[part]))
            print(f"  sweep {part} {cfg[part]}: T=1 {ts[0] * 1e6:.1f} us, T=4 {ts[1] * 1e6:.1f} us")
        results.sort(key=lambda r: r[0])
        best[part] = results[0][2]
        print(f"best {part}: {best[part]}")
    print(f"DECODE_CONFIG = {best}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8, help="bank copies cycled by decode calls")
    ap.add_argument("--repeat", type=int, default=4, help="passes over the layers per graph")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--prefill", default="4096")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_triton_moe.py needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, I, E = args.hidden, args.inter, args.experts
    banks = [((torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).bfloat16(),
              (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).bfloat16())
             for _ in range(args.layers)]
    print(f"{torch.cuda.get_device_name()}: H={H} I={I} E={E} K={args.top_k} bf16, "
          f"{args.layers} layers of banks, DECODE_CONFIG={DECODE_CONFIG}")
    for T in [int(t) for t in args.tokens.split(",") if t]:
        decode_case(T, banks, args, gen)
    for T in [int(t) for t in args.prefill.split(",") if t]:
        prefill_case(T, banks, args, gen)
    router_case(args, gen)
    if args.sweep:
        sweep(banks, args, gen)


if __name__ == "__main__":
    main()
