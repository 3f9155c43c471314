"""Benchmark the Triton fused MoE (freetoken/kernels/triton/fused_moe.py) against torch, on the GPU.

Qwen3.6-35B-A3B shape by default: H=2048, I=512, E=256, top-8, bf16. Prints per case the time
per MoE layer, the weight bytes of the distinct experts the call must read, the achieved GB/s
and the floor (bytes / HBM bandwidth), beside torch's baseline in the same process:
`gathered_experts` (gather + bmm) for decode, `dispatch_experts` (a loop over experts) for the
prefill. Decode calls cycle over --layers copies of the banks with fresh routing each call, so
the L2 (50 MB, one layer's 8 experts) cannot serve a call from the previous one.

    python scripts/bench_triton_moe.py [--tokens 1,4,16] [--prefill 4096] [--sweep]

--sweep times a grid of decode tiles (gate_up, then down) at T=1 and T=4 and prints the best,
for DECODE_CONFIG in freetoken/kernels/triton/fused_moe.py, then a few grouped tiles at the first
--prefill size (for GROUPED_CONFIGS in freetoken/kernels/triton/moe_grouped.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from freetoken.kernels.triton.fused_moe import DECODE_CONFIG, fused_moe, fused_moe_decode
from freetoken.kernels.triton.moe_grouped import fused_moe_grouped, tile
from freetoken.kernels.triton.router import fused_router
from freetoken.kernels.triton.tuned import gpu_file_name
from freetoken.layers.moe import dispatch_experts, gathered_experts

DEV = "cuda"  # a constant so a CPU dry run (interpreter, tiny shapes) can reuse the script
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
    return torch.rand(T, E, device=DEV, generator=gen).topk(K, dim=-1).indices  # [T, K]


def expert_bytes(ids: torch.Tensor, H: int, I: int, elt: int) -> int:
    return int(ids.unique().numel()) * 3 * H * I * elt


def row(name: str, secs: float, nbytes: int, floor_s: float) -> None:
    print(f"  {name:<34} {secs * 1e6:9.1f} us  {nbytes / secs / 1e9:8.0f} GB/s"
          f"  floor {floor_s * 1e6:7.1f} us  ({floor_s / secs:5.1%} of floor speed)")


def decode_case(T, banks, args, gen):
    H, I, E, K = args.hidden, args.inter, args.experts, args.top_k
    calls_t, calls_g, calls_b, bytes_total = [], [], [], 0
    for layer, (gu, dn) in enumerate(banks * args.repeat):
        x = torch.randn(T, H, device=DEV, dtype=gu.dtype)
        ids = route(T, E, K, gen)
        y = torch.empty(T, K, H, device=DEV, dtype=gu.dtype)
        bytes_total += expert_bytes(ids, H, I, gu.element_size())
        calls_t.append(lambda x=x, ids=ids, gu=gu, dn=dn, y=y: fused_moe(x, ids, gu, dn, y,
                                                                        decode=True))
        calls_g.append(lambda x=x, ids=ids, gu=gu, dn=dn, y=y: fused_moe(x, ids, gu, dn, y,
                                                                        decode=False))
        calls_b.append(lambda x=x, ids=ids, gu=gu, dn=dn, y=y: gathered_experts(x, ids, gu, dn, y))
    nbytes = bytes_total // len(calls_t)
    print(f"T={T} decode ({T * K} entries, {nbytes / 1e6:.1f} MB of distinct experts per layer)")
    for name, calls in (("triton decode path", calls_t), ("torch gathered_experts", calls_b)):
        row(name + " (graph)", time_graph(calls), nbytes, nbytes / HBM)
    # eager: whether the grouped path (device sort included) captures is probed at the end,
    # where a failed capture cannot disturb the other figures
    row("triton grouped path (eager)", time_eager(lambda: [c() for c in calls_g]) / len(calls_g),
        nbytes, nbytes / HBM)
    return nbytes, calls_g


def grouped_capture_probe(T, nbytes, calls):
    try:
        row(f"T={T} triton grouped path (graph)", time_graph(calls), nbytes, nbytes / HBM)
    except Exception as exc:  # noqa: BLE001  (any capture failure is the answer here)
        print(f"T={T} grouped path cannot be captured: {type(exc).__name__}: {str(exc)[:200]}")


def prefill_case(T, banks, args, gen):
    H, I, E, K = args.hidden, args.inter, args.experts, args.top_k
    gu, dn = banks[0]
    x = torch.randn(T, H, device=DEV, dtype=gu.dtype)
    ids = route(T, E, K, gen)
    y = torch.empty(T, K, H, device=DEV, dtype=gu.dtype)
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
    H, E, K = args.hidden, args.experts, args.top_k
    weight = (torch.randn(E, H, device=DEV, generator=gen) / H**0.5).bfloat16()

    def torch_router(x):  # Router.forward's torch path (on CUDA the Router calls fused_router)
        probs = F.softmax(F.linear(x, weight), dim=-1, dtype=torch.float)  # [T, E]
        w, ids = torch.topk(probs, K, dim=-1)
        return (w / w.sum(-1, keepdim=True)).to(x.dtype), ids

    for T in (1, 4096):
        x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
        tt = time_graph([lambda x=x: fused_router(x, weight, K, True)] * 20)
        tr = time_graph([lambda x=x: torch_router(x)] * 20)
        print(f"router T={T}: fused_router {tt * 1e6:.1f} us, torch softmax+topk {tr * 1e6:.1f} us")


def sweep(banks, args, gen):
    H, E, K = args.hidden, args.experts, args.top_k
    dtype = banks[0][0].dtype

    def timed(T, cfg):
        calls = []
        for gu, dn in banks * args.repeat:
            x = torch.randn(T, H, device=DEV, dtype=dtype)
            ids, y = route(T, E, K, gen), torch.empty(T, K, H, device=DEV, dtype=dtype)
            calls.append(lambda x=x, ids=ids, gu=gu, dn=dn, y=y:
                         fused_moe_decode(x, ids, gu, dn, y, config=cfg))
        # the tiles must not change the answer: one call against torch's gather + bmm
        gu, dn = banks[0]
        x, ids = torch.randn(T, H, device=DEV, dtype=dtype), route(T, E, K, gen)
        y, want = (torch.empty(T, K, H, device=DEV, dtype=dtype) for _ in range(2))
        fused_moe_decode(x, ids, gu, dn, y, config=cfg)
        gathered_experts(x, ids, gu, dn, want)
        err = float((y.float() - want.float()).norm() / want.float().norm())
        if err > 2e-2:
            raise SystemExit(f"decode tiles {cfg} give a wrong answer: relative error {err:.3g}")
        return time_graph(calls, rounds=3)

    best = {k: dict(v) for k, v in DECODE_CONFIG.items()}
    for part, bns, bks in (("gate_up", (8, 16, 32), (128, 256, 512)),
                           ("down", (16, 32, 64), (64, 128, 256))):
        results = []
        for bn, bk, warps in itertools.product(bns, bks, (4, 8)):
            cfg = {**best, part: {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}}
            ts = [timed(T, cfg) for T in (1, 4)]
            results.append((sum(ts), ts, cfg[part]))
            print(f"  sweep {part} {cfg[part]}: T=1 {ts[0] * 1e6:.1f} us, T=4 {ts[1] * 1e6:.1f} us")
        results.sort(key=lambda r: r[0])
        best[part] = results[0][2]
        print(f"best {part}: {best[part]}")
    print(f"DECODE_CONFIG = {best}")
    # the entry for freetoken/kernels/triton/configs/<gpu>.json (freetoken/kernels/triton/tuned.py)
    gpu = gpu_file_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else "x.json"
    entry = {"fused_moe_decode": {f"H={H},I={banks[0][1].shape[2]}": best}}
    print(f"freetoken/kernels/triton/configs/{gpu}: {json.dumps(entry)}", flush=True)
    if args.no_grouped:
        return
    T = int(args.prefill.split(",")[0]) if args.prefill else 4096
    gu, dn = banks[0]
    x, ids = torch.randn(T, H, device=DEV, dtype=dtype), route(T, E, K, gen)
    y = torch.empty(T, K, H, device=DEV, dtype=dtype)
    results = []
    # BLOCK_M is shared: it is the padding of the sorted entries both kernels read
    for bm, (gbn, gbk), (dbn, dbk) in itertools.product(
            (64, 128), ((64, 64), (128, 64)), ((128, 64), (256, 64), (64, 128))):
        w = 8 if bm == 128 else 4
        cfg = (tile(bm, gbn, gbk, 8, w, 3), tile(bm, dbn, dbk, 8, w, 3))
        try:
            t = time_eager(lambda cfg=cfg: fused_moe_grouped(x, ids, gu, dn, y, config=cfg))
        except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: skip the tile)
            print(f"  sweep grouped T={T} {cfg}: failed {type(exc).__name__}")
            continue
        results.append((t, cfg))
        print(f"  sweep grouped T={T} {cfg}: {t * 1e6:.1f} us")
    if results:
        t, cfg = min(results, key=lambda r: r[0])
        print(f"best grouped T={T}: {t * 1e6:.1f} us with gate_up {cfg[0]}, down {cfg[1]}")


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
    ap.add_argument("--no-grouped", action="store_true", help="--sweep: the decode tiles only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_triton_moe.py needs CUDA")
    gen = torch.Generator(device=DEV).manual_seed(0)
    H, I, E = args.hidden, args.inter, args.experts
    banks = [((torch.randn(E, 2 * I, H, device=DEV, generator=gen) / H**0.5).bfloat16(),
              (torch.randn(E, H, I, device=DEV, generator=gen) / I**0.5).bfloat16())
             for _ in range(args.layers)]
    print(f"{torch.cuda.get_device_name()}: H={H} I={I} E={E} K={args.top_k} bf16, "
          f"{args.layers} layers of banks, DECODE_CONFIG={DECODE_CONFIG}")
    probes = [(T, *decode_case(T, banks, args, gen))
              for T in [int(t) for t in args.tokens.split(",") if t]]
    for T in [int(t) for t in args.prefill.split(",") if t]:
        prefill_case(T, banks, args, gen)
    router_case(args, gen)
    if args.sweep:
        sweep(banks, args, gen)
    for probe in probes:
        grouped_capture_probe(*probe)


if __name__ == "__main__":
    main()
