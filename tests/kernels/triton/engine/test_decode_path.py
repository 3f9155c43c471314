"""The decode step on the CUDA code path (every fast_ops switch on our Triton kernels, run by
the interpreter on the CPU) against the torch path, through the graph runner's static buffers on
the tiny hybrid model (fp32): same logits to fp32 rounding and the same greedy tokens, with 3
real rows in a bucket of 4 (one padding row). Bugs it catches: a fused kernel that changes the
model's output (the shared expert folded into the routed launches, its gate computed in the
combine, padding rows masked by the router, y left uncleared, the gated norm's folded cast, the
attention gate kernel), and a padding row leaking into real rows."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("interprets the CUDA path on CPU tensors; the gpu-marked tests cover "
                "the GPU",
                allow_module_level=True)

from freetoken.engine.decode_staging import DecodeRow
from freetoken.experts.base import ExpertBackend
from freetoken.types.forward_batch import MoEStep
from tests.kernels.triton.engine.inventory import Ops, count_triton, cuda_path, decode_runner

STEPS, ROWS = 2, 3


class _Delegate(ExpertBackend):
    """Stands for any backend other than `fused` (offload, hybrid...): the block then runs its
    shared expert on its own (two launches of the decode kernels on the CUDA path)."""

    name = "delegate"

    def __init__(self, inner: ExpertBackend):
        super().__init__()
        self.inner = inner

    def forward(self, x, topk_ids, step, shared=None):
        return self.inner(x, topk_ids, step)  # (no shared: the block runs it)


def _decode(model_dir, fast: bool):
    """Greedy tokens and logits [STEPS, Bk, V] of STEPS decode steps of ROWS rows."""
    undo = cuda_path() if fast else None
    try:
        runner, _, _ = decode_runner(model_dir, ROWS, torch.float32)  # one warm step at pos 10
        if not fast:
            runner.attention = "torch"
        logits: list[torch.Tensor] = []
        hook = runner.model.register_forward_hook(lambda m, a, out: logits.append(out.clone()))
        tokens = []
        for s in range(STEPS):
            p = 11 + s
            rows = [DecodeRow(token=7 + b + s, position=p, out_slot=20 * b + p, state_slot=b,
                              kv_slots=torch.arange(20 * b, 20 * b + p + 1))
                    for b in range(ROWS)]
            tokens.append(runner.step(rows))
        hook.remove()
    finally:
        if undo is not None:
            undo()
    return tokens, torch.stack(logits)


def test_cuda_path_decode_equals_torch_path(tiny_hf):
    path = tiny_hf("qwen3_5_moe")
    ref_tokens, ref = _decode(path, fast=False)
    tokens, got = _decode(path, fast=True)
    real, want = got[:, :ROWS], ref[:, :ROWS]  # [STEPS, ROWS, V]; not the padding row
    assert ((real - want).norm() / want.norm()).item() < 1e-5
    assert tokens == ref_tokens


@pytest.mark.parametrize("delegate", [False, True])
def test_moe_block_cuda_path_equals_torch_path(tiny_hf, delegate):
    """One MoE block on 3 rows, the middle one masked out, with `fused` (shared expert inside
    the routed launches) and with another backend (the shared expert in its own two launches),
    against the block's torch path; a masked row gets the residual plus the shared expert only.
    """
    from freetoken.models.loader import load_model

    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    block = model.moe_blocks()[0]
    if delegate:
        block.experts = _Delegate(block.experts)
    g = torch.Generator().manual_seed(5)
    H = model.cfg.hidden_size
    x, res = torch.randn(3, H, generator=g), torch.randn(3, H, generator=g)
    mask = MoEStep(row_mask=torch.tensor([True, False, True]))
    with torch.inference_mode():
        want = block(x, mask, residual=res)
        undo = cuda_path()
        mode = Ops()
        try:
            with mode, count_triton(mode):
                got = block(x, mask, residual=res)
        finally:
            undo()
        shared = block.shared_expert(x[1:2])
        gate = torch.sigmoid(block.shared_expert_gate(x[1:2]))
    ops = {name: n for (_, name), n in mode.ops.items()}
    # the router's GEMM is the block's only torch op; the shared expert rides in the routed
    # launches under `fused`, in two launches of its own otherwise
    assert ops.pop("linear") == 1 and ops.pop("triton:_decode_gate_up_kernel") == 1 + delegate
    assert ops.pop("triton:_decode_down_kernel") == 1 + delegate
    assert set(ops) == {"triton:_router_topk_kernel", "triton:_combine_kernel"}, ops
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    assert torch.allclose(got[1:2], res[1:2] + gate * shared, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_slot_backend_runs_the_shared_expert_in_its_launches(tiny_hf, backend):
    """A slot backend (its GPU share computed through slot ids) on the CUDA path runs the
    block's shared expert in the same two decode launches as its routed slots, over a cache
    too small for the step (offload fetches, hybrid sends a share to the CPU), and the block
    equals its torch path and the `fused` block. Bugs caught: the shared expert run twice or
    not at all, CPU entries left as the slot kernel's zeros, a slot output written over the
    CPU's rows."""
    from freetoken.experts.runtime import MoERuntime
    from freetoken.models.loader import load_model
    from freetoken.types.config import MoEConfig

    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(6)
    H = model.cfg.hidden_size
    x, res = torch.randn(2, H, generator=g), torch.randn(2, H, generator=g)
    mask = MoEStep(row_mask=torch.tensor([True, True]))
    with torch.inference_mode():
        want = model.moe_blocks()[0](x, mask, residual=res)  # fused, torch path
        stats = MoERuntime.build(model, MoEConfig(backend=backend, cache_size=3),
                                 "cpu").counters
        block = model.moe_blocks()[0]
        undo = cuda_path()
        mode = Ops()
        try:  # first, on the cold cache: the step misses
            with mode, count_triton(mode):
                got = block(x, mask, residual=res)
        finally:
            undo()
        misses, cpu_experts = stats.misses, stats.cpu_experts
        torch_path = block(x, mask, residual=res)
    ops = {name: n for (_, name), n in mode.ops.items()}
    assert ops["triton:_decode_gate_up_kernel"] == 1 and ops["triton:_decode_down_kernel"] == 1
    assert misses > 0 and (cpu_experts > 0) == (backend == "hybrid")
    assert ((torch_path - want).norm() / want.norm()).item() < 1e-6
    assert ((got - want).norm() / want.norm()).item() < 1e-6
