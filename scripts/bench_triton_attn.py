"""Time the Triton decode-step kernels (paged attention, gated DeltaNet conv + recurrent step,
RMSNorms) against the torch path the engine runs today, in one process on one GPU, at
Qwen3.6-35B-A3B shapes in bf16.

Each row prints: microseconds per call eager and under CUDA-graph replay (the kernels only; the
torch path eager only, as the engine runs it now), the achieved GB/s over the bytes the op must
move, and the floor = bytes / 4.0e12 (H200 HBM).

    python scripts/bench_triton_attn.py [--iters 200]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from freetoken.kernels.triton.gdn import causal_conv1d_update_pool, gdn_gates, gdn_recurrent_pool
from freetoken.kernels.triton.norm import gated_rmsnorm, rmsnorm, rmsnorm_rope
from freetoken.kernels.triton.paged_attention import (
    paged_decode_attention,
    paged_prefill_attention,
)
from freetoken.layers.attention import Attention
from freetoken.layers.gated_delta import recurrent_gated_delta
from freetoken.layers.linear_attention import _l2norm
from freetoken.layers.norm import GatedRMSNorm, RMSNorm
from freetoken.layers.rotary import Rotary, apply_rotary

HQ, HK, D = 16, 2, 256
LHK, LHV, LD, KC = 16, 32, 128, 4
C = 2 * LHK * LD + LHV * LD
H = 2048
BF = torch.bfloat16
HBM = 4.0e12


def eager_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def graph_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(1, iters // 10)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * 10)


def row(name: str, impl: str, nbytes: float, eager: float, graph: float | None) -> None:
    best = graph if graph is not None else eager
    g = f"{graph:9.1f}" if graph is not None else "        -"
    print(f"{name:34s} {impl:6s} {eager:9.1f} {g} {nbytes / best / 1e3:8.1f} "
          f"{nbytes / HBM * 1e6:8.2f}")


def bench_decode_attention(B: int, L: int, iters: int) -> None:
    S = B * L + 1024
    k_pool = torch.randn(S, HK, D, device="cuda", dtype=BF)
    v_pool = torch.randn(S, HK, D, device="cuda", dtype=BF)
    idx = torch.randperm(S, device="cuda")[:B * L].int()
    indptr = torch.arange(B + 1, device="cuda", dtype=torch.int32) * L
    q = torch.randn(B, HQ, D, device="cuda", dtype=BF)
    nbytes = 2 * B * L * HK * D * 2 + 4 * B * L
    fake = SimpleNamespace(scale=D ** -0.5, hq=HQ, hk=HK)
    slots = [idx[b * L:(b + 1) * L].long() for b in range(B)]

    def torch_path():
        for b in range(B):
            Attention._attend(fake, q[b:b + 1], k_pool[slots[b]], v_pool[slots[b]], L - 1)

    def kernel():
        paged_decode_attention(q, k_pool, v_pool, indptr, idx, D ** -0.5)

    name = f"decode attn B={B} L={L}"
    row(name, "torch", nbytes, eager_us(torch_path, iters), None)
    row(name, "triton", nbytes, eager_us(kernel, iters), graph_us(kernel, iters))


def bench_prefill_attention(n: int, iters: int) -> None:
    k_pool = torch.randn(n + 64, HK, D, device="cuda", dtype=BF)
    v_pool = torch.randn(n + 64, HK, D, device="cuda", dtype=BF)
    idx = torch.randperm(n + 64, device="cuda")[:n].int()
    kv = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    q = torch.randn(n, HQ, D, device="cuda", dtype=BF)
    nbytes = 2 * n * HK * D * 2 + 2 * n * HQ * D * 2
    fake = SimpleNamespace(scale=D ** -0.5, hq=HQ, hk=HK)
    sl = idx.long()
    name = f"prefill attn n=L={n}"
    row(name, "torch", nbytes,
        eager_us(lambda: Attention._attend(fake, q, k_pool[sl], v_pool[sl], 0), iters), None)
    t = eager_us(lambda: paged_prefill_attention(q, k_pool, v_pool, kv, kv, idx, D ** -0.5),
                 iters)
    row(name, "triton", nbytes, t, None)
    flops = 2 * 2 * HQ * D * n * n / 2  # QK^T and PV over the causal half
    print(f"{'':34s} triton {flops / t / 1e6:.1f} TFLOP/s (causal)")


def bench_gdn(B: int, iters: int) -> None:
    S = 64
    ssm = torch.randn(S, LHV, LD, LD, device="cuda") * 0.1
    conv = torch.randn(S, C, KC - 1, device="cuda", dtype=BF)
    w = torch.randn(C, KC, device="cuda", dtype=BF)
    x = torch.randn(B, C, device="cuda", dtype=BF)
    slots = torch.randperm(S, device="cuda")[:B]
    g, beta = -torch.rand(B, LHV, device="cuda"), torch.rand(B, LHV, device="cuda")
    kd, r = LHK * LD, LHV // LHK

    def conv_torch():
        window = torch.cat([conv[slots], x[:, :, None]], -1)
        conv[slots] = window[..., 1:]
        return F.silu((window * w).sum(-1))

    def rec_torch():
        q = _l2norm(x[:, :kd].float().view(B, LHK, LD)).repeat_interleave(r, dim=1)
        k = _l2norm(x[:, kd:2 * kd].float().view(B, LHK, LD)).repeat_interleave(r, dim=1)
        o, s = recurrent_gated_delta(q, k, x[:, 2 * kd:].view(B, LHV, LD), g, beta, ssm[slots])
        ssm[slots] = s
        return o

    def rec_kernel():
        return gdn_recurrent_pool(x[:, :kd].view(B, LHK, LD), x[:, kd:2 * kd].view(B, LHK, LD),
                                  x[:, 2 * kd:].view(B, LHV, LD), g, beta, ssm, slots)

    def conv_kernel():
        return causal_conv1d_update_pool(x, conv, w, slots)

    conv_bytes = B * C * (KC - 1) * 2 * 2 + 2 * B * C * 2 + C * KC * 2
    rec_bytes = B * LHV * LD * LD * 4 * 2 + B * C * 2 + B * LHV * LD * 4
    row(f"gdn conv update B={B}", "torch", conv_bytes, eager_us(conv_torch, iters), None)
    row(f"gdn conv update B={B}", "triton", conv_bytes, eager_us(conv_kernel, iters),
        graph_us(conv_kernel, iters))
    a, bb = torch.randn(B, LHV, device="cuda", dtype=BF), torch.randn(B, LHV, device="cuda",
                                                                    dtype=BF)
    a_log, dt_bias = torch.randn(LHV, device="cuda"), torch.randn(LHV, device="cuda")
    gate_bytes = B * LHV * (2 + 2 + 4 + 2) + LHV * 8

    def gates_torch():
        return -a_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(bb)

    def gates_kernel():
        return gdn_gates(a, bb, a_log, dt_bias)

    row(f"gdn gates B={B}", "torch", gate_bytes, eager_us(gates_torch, iters), None)
    row(f"gdn gates B={B}", "triton", gate_bytes, eager_us(gates_kernel, iters),
        graph_us(gates_kernel, iters))
    row(f"gdn recurrent B={B}", "torch", rec_bytes, eager_us(rec_torch, iters), None)
    row(f"gdn recurrent B={B}", "triton", rec_bytes, eager_us(rec_kernel, iters),
        graph_us(rec_kernel, iters))


def bench_norms(T: int, iters: int) -> None:
    x, h = torch.randn(T, H, device="cuda", dtype=BF), torch.randn(T, H, device="cuda", dtype=BF)
    mod = RMSNorm(H, 1e-6, True).cuda().to(BF)
    nbytes = T * H * 2 * 4 + H * 2

    def res_torch():
        return mod(x + h)

    row(f"add+rmsnorm(1+w) T={T} H={H}", "torch", nbytes, eager_us(res_torch, iters), None)
    kern = lambda: rmsnorm(h, mod.weight, 1e-6, True, residual=x)
    row(f"add+rmsnorm(1+w) T={T} H={H}", "triton", nbytes, eager_us(kern, iters),
        graph_us(kern, iters))
    q = torch.randn(T, HQ, 2 * D, device="cuda", dtype=BF)[..., :D]  # gated q half
    qn = RMSNorm(D, 1e-6, True).cuda().to(BF)
    cos, sin = Rotary(D // 4, 1e7).cos_sin(torch.arange(T, device="cuda") + 4000, BF)
    qbytes = T * HQ * D * 2 * 2
    name = f"q norm+rope T={T} Hq={HQ}"
    row(name, "torch", qbytes, eager_us(lambda: apply_rotary(qn(q), cos, sin), iters), None)
    kern = lambda: rmsnorm_rope(q, qn.weight, 1e-6, True, cos, sin)
    row(name, "triton", qbytes, eager_us(kern, iters), graph_us(kern, iters))
    core, z = (torch.randn(T, LHV, LD, device="cuda", dtype=BF) for _ in range(2))
    gn = GatedRMSNorm(LD, 1e-6).cuda().to(BF)
    gbytes = T * LHV * LD * 2 * 3
    row(f"gated rmsnorm T={T}", "torch", gbytes, eager_us(lambda: gn(core, z), iters), None)
    kern = lambda: gated_rmsnorm(core, z, gn.weight, 1e-6)
    row(f"gated rmsnorm T={T}", "triton", gbytes, eager_us(kern, iters), graph_us(kern, iters))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_triton_attn: needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}  bf16  floor = bytes / {HBM:.1e} B/s")
    print(f"{'op':34s} {'impl':6s} {'eager us':>9s} {'graph us':>9s} {'GB/s':>8s} "
          f"{'floor us':>8s}")
    for B, L in ((1, 4096), (1, 32768), (4, 4096), (16, 4096)):
        bench_decode_attention(B, L, args.iters)
    for n in (2048, 8192):
        bench_prefill_attention(n, max(5, args.iters // 20))
    for B in (1, 8):
        bench_gdn(B, args.iters)
    for T in (1, 16):
        bench_norms(T, args.iters)


if __name__ == "__main__":
    main()
