"""On the GPU: the kernels one eager decode step really launches (torch.profiler, CUDA
activity), against the count made on the CPU through the interpreter (docs/kernels.md,
tests/engine/test_decode_budget.py). The tiny hybrid model in bf16, batch 1; its head dim (16)
keeps flashinfer out, so attention is the Triton split + merge the CPU count assumes. Run with
`-s` to see the kernel table. Bug it catches: a fusion that holds on the interpreter's path but
not on CUDA (a stray copy, a fallback taken), or cuBLAS adding more than a few reduces. (One
device-to-device copy is expected: the sampled ids into the runner's output buffer.)"""
from __future__ import annotations

import collections

import pytest
import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.decode_staging import DecodeRow
from freetoken.models.loader import load_model

pytestmark = pytest.mark.gpu

COUNTED = 72  # CUDA_STEP_TOTAL of tests/engine/test_decode_budget.py (4 layers, batch 1)
CUBLAS_SLACK = 8  # split-K reduces cuBLAS may add to the 14 GEMMs of the step


def test_eager_decode_step_kernel_count(tiny_hf) -> None:
    model = load_model(tiny_hf("qwen3_5_moe", torch.bfloat16), dtype=torch.bfloat16,
                       device="cuda", progress=False)
    core = EngineCore(model, [2], kv_tokens=256, state_slots=8, max_running=4,
                      decode_runner=True, cuda_graph=False)
    runner = core.runner
    assert runner is not None and runner.attention == "triton"
    rows = [DecodeRow(token=5, position=10, out_slot=10, state_slot=0,
                      kv_slots=torch.arange(0, 11))]
    runner.step(rows)  # compile every kernel, lazy state
    bk = runner.bucket(1)
    _, total = runner._stage(rows, bk.size)
    runner._upload(bk.size, total)
    attn = runner._attn(bk, rows)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner._forward(bk.size, attn, greedy=True)
        torch.cuda.synchronize()
    kernels = collections.Counter(e.name for e in prof.events()
                                  if e.device_type == torch.autograd.DeviceType.CUDA)
    n = sum(kernels.values())
    print(f"\n{n} device activities in one decode step (counted on the CPU: {COUNTED})")
    for name, c in kernels.most_common():
        print(f"{c:4d}  {name[:100]}")
    if n == 0:
        pytest.skip("the profiler recorded no CUDA activity here")
    assert n <= COUNTED + CUBLAS_SLACK, kernels.most_common()
