"""A budget on what one decode step through the runner's static buffers issues (the path CUDA
graphs capture), counted on the CPU with a dispatch mode: aten ops per step and blocking calls
(ops whose result size or value must reach the host: .item()/.tolist(), nonzero, masked_select,
unique, boolean-mask indexing). Bug it catches: a change that adds per-layer work or a host
sync to the decode step (on CUDA a sync inside the step also breaks graph capture).

The CPU runs the torch fallbacks of the Triton kernels (conv and gated-delta updates by
index_select/index_copy_, zero-centred norms as ~8 ops), so the op count here is larger than
the CUDA step's kernel count; it is a regression budget, not the GPU figure (that one is
`scripts/profile_decode.py --sort device`).

`test_cuda_path_kernels_per_layer` counts the CUDA path itself: the same step with every
fast_ops switch on our Triton kernels, interpreted on the CPU (tests/kernels/triton/engine/
inventory.py), one launch per kernel-launching op or Triton kernel, per decoder layer."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (interpreted here)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from torch.utils._python_dispatch import TorchDispatchMode

from freetoken.engine.core import EngineCore
from freetoken.engine.decode_staging import DecodeRow
from freetoken.experts import ffn
from freetoken.experts.ffn import gathered_experts
from freetoken.models.loader import load_model

# Blocking on CUDA: the op's output shape or value depends on device data.
BLOCKING = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique2",
            "unique_consecutive", "index_put_with_bool", "repeat_interleave_tensor"}
# Budgets (aten ops per decode step of the tiny 4-layer hybrid model, batch 1 and 3 rows in a
# padded bucket of 4): measured 622 and 664 on 2026-11-30, plus ~5 % headroom.
OPS_BUDGET = {1: 655, 4: 700}
BLOCKING_BUDGET = 0
# Launches per decoder layer on the CUDA path (tiny hybrid model, bf16, batch 1 and 3; a layer past
# the first), counted on 2026-11-30 (docs/kernels.md has the inventory): gated-DeltaNet + MoE
# layer 22 -> 11 and attention + MoE layer 26 -> 13 after the decode fusions (shared expert in
# the routed MoE launches, its gate and the next layer's input norm in the combine, padding
# rows masked by the router, no y clear, the gated norm's folded cast, the DeltaNet gates in
# the recurrent kernel, the attention gate in one kernel, K norm + rotary + both pool writes in
# one kernel). No headroom: each launch is ~2 us of the step.
CUDA_LAYER_BUDGET = {"gdn": 11, "attn": 13}
# 4 layers + input-id gather (chained steps), embedding, rotary tables, final norm, LM head,
# sampling; + 6 since 2026-12-02 for row isolation (issue #22): the failed-row check of the
# sampler (gather, sub, eq, where on [B]) and the clamp of chained ids the runner feeds
CUDA_STEP_TOTAL = 72


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "index" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                   for a in (args[1] if len(args) > 1 else []) if a is not None):
            name = "index_put_with_bool"
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _step_counts(tiny_hf, rows: int, monkeypatch) -> _Count:
    # the routed experts as on CUDA without triton: the gathered batched GEMV (sync-free); the
    # CPU's own expert path (the C++ kernel, boolean-mask merges) is not what graphs capture
    monkeypatch.setattr(ffn, "fused_moe", lambda x, ids, gu, dn, y:
                        gathered_experts(x, ids, gu, dn, y))
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    core = EngineCore(model, [2], kv_tokens=256, state_slots=8, max_running=4,
                      decode_runner=True)
    runner = core.runner
    assert runner is not None
    dec = [DecodeRow(token=5 + b, position=10, out_slot=20 * b + 10, state_slot=b,
                     kv_slots=torch.arange(20 * b, 20 * b + 11)) for b in range(rows)]
    runner.step(dec)  # lazy state (rotary tables, buffers) out of the way
    bk = runner.bucket(rows)
    _, total = runner._stage(dec, bk.size)
    runner._upload(bk.size, total)
    attn = runner._attn(bk, dec)
    with _Count() as c:
        runner._forward(bk.size, attn, greedy=True)
    return c


def test_decode_step_budget(tiny_hf, monkeypatch) -> None:
    for rows in (1, 3):
        c = _step_counts(tiny_hf, rows, monkeypatch)
        total = sum(c.ops.values())
        blocking = {k: v for k, v in c.ops.items() if k in BLOCKING}
        budget = OPS_BUDGET[1 if rows == 1 else 4]
        assert total <= budget, (rows, total, sorted(c.ops.items(), key=lambda kv: -kv[1])[:12])
        assert sum(blocking.values()) <= BLOCKING_BUDGET, (rows, blocking)


def test_cuda_path_kernels_per_layer(tiny_hf) -> None:
    if torch.cuda.is_available():
        pytest.skip("counts the CUDA path through the interpreter, on a CPU-only machine")
    pytest.importorskip("triton")
    from tests.kernels.triton.engine.inventory import count_step, per_layer

    for rows in (1, 3):  # 3: a padded bucket of 4 (strided views must not be copied there)
        ops = count_step(tiny_hf("qwen3_5_moe", torch.bfloat16), rows=rows)
        counts = per_layer(ops)
        for kind, budget in CUDA_LAYER_BUDGET.items():
            c = counts[kind]
            assert sum(c.values()) <= budget, (rows, kind,
                                               sorted(c.items(), key=lambda kv: -kv[1]))
        assert sum(ops.values()) <= CUDA_STEP_TOTAL, (rows, sorted(ops.items(),
                                                                   key=lambda kv: -kv[1]))


def test_capture_staging_with_no_rows(tiny_hf) -> None:
    """Bug caught (H200 run, session 4): capture stages a bucket of padding rows only, and the
    numpy staging failed on an empty row list (every CUDA graph capture raised). The staged
    bucket must be all padding: scratch KV slots, masked rows, one key per row."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    core = EngineCore(model, [2], kv_tokens=256, state_slots=8, max_running=4,
                      decode_runner=True)
    r = core.runner
    ptr, total = r._stage([], 4)
    assert total == 4 and ptr.tolist() == [0, 1, 2, 3, 4]
    assert r.h_mask[:4].tolist() == [False] * 4
    assert r.h_i64[2, :4].tolist() == [r.scratch_kv] * 4
    assert r.h_indices[:4].tolist() == [r.scratch_kv] * 4
