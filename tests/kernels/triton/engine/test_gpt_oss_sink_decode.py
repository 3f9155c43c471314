"""gpt-oss's decode step through the graph runner's static buffers on the CUDA runner's attention
plan, `triton_sink` (sinks + the sliding layers' window over the step's CSR in
freetoken/kernels/triton/sink_attention.py), interpreted on CPU tensors, against transformers
(eager, fp32) and the runner's torch plan. Rows are longer than the window (6) on the sliding
layers, and one is shorter. Bugs it catches: the sink dropped or taken twice, a window cut at the
wrong end or on the full layers, the plan reading another row's slots, the kernel not launched once
per layer."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("interprets the CUDA path on CPU tensors; test_sink_attention_gpu.py "
                "runs it for real",
                allow_module_level=True)

from freetoken.engine.attention_plans import choose_sink_backend
from freetoken.engine.core import EngineCore
from freetoken.engine.graph_runner import DecodeRow
from freetoken.models.loader import load_model
from freetoken.types.forward_batch import ForwardBatch
from tests.kernels.triton.engine.inventory import Ops, count_triton
from tests.models.fixtures_gpt_oss import CONFIG, build_gpt_oss, gpt_oss_reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = build_gpt_oss(tmp_path_factory.mktemp("gpt-oss-sink-decode"))
    return d, gpt_oss_reference(d)


def _runner_logits(d, seqs: list[list[int]], attention: str, mode: Ops | None = None):
    model = load_model(d, dtype=torch.float32, progress=False)
    core = EngineCore(model, [2], kv_tokens=256, state_slots=4, max_running=4,
                      decode_runner=True)
    runner = core.runner
    assert runner.attention == "torch"  # a CPU runner
    runner.attention = attention  # what a CUDA runner plans for this family
    rows = []
    for b, s in enumerate(seqs):
        slots = torch.arange(60 * b + 3, 60 * b + 3 + len(s))  # scattered across the pool
        model(ForwardBatch.single(s[:-1], 0, slots[:-1], None), core.caches)
        rows.append(DecodeRow(token=s[-1], position=len(s) - 1, out_slot=int(slots[-1]),
                              state_slot=-1, kv_slots=slots))
    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda m, a, out: logits.append(out.clone()))
    try:
        if mode is None:
            runner.step(rows)
        else:
            with mode, count_triton(mode):
                runner.step(rows)
    finally:
        hook.remove()
    return logits[-1][: len(seqs)]  # [B, V]; not a bucket's padding rows


def test_cuda_runner_plans_the_sink_kernel() -> None:
    assert choose_sink_backend() == "triton_sink"


def test_sink_plan_matches_transformers_and_the_torch_plan(ckpt) -> None:
    d, ref = ckpt
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, CONFIG["vocab_size"], (n,), generator=g).tolist()
            for n in (17, 4, 30)]
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in seqs])  # [B, V]
    torch_plan = _runner_logits(d, seqs, "torch")
    assert ((torch_plan - want).norm() / want.norm()).item() < 1e-5
    mode = Ops()
    got = _runner_logits(d, seqs, "triton_sink", mode)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert ((got - torch_plan).norm() / want.norm()).item() < 1e-5
    layers = CONFIG["num_hidden_layers"]
    assert mode.ops[("step", "triton:_sink_split_kernel")] == layers, mode.ops
    assert mode.ops[("step", "triton:_sink_merge_kernel")] == layers, mode.ops
