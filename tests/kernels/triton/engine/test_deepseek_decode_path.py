"""DeepSeek-V3's and Kimi-Linear's decode step through the graph runner's static buffers (a
DecodeContext: device out-slots and state slots, the runner's 'torch' attention plan over the
latent pool), on the torch path and on the CUDA code path (every fast_ops switch on our Triton
kernels, interpreted on the CPU: norms, fused MoE decode, shared-expert decode, combine),
against transformers. Bugs it catches: the ungated shared expert lost or gated by the combine,
MLA writing latents where the runner did not plan them, a runner planning a GQA kernel over the
latent pool, KDA reading or writing another row's state slot."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("interprets the CUDA path on CPU tensors", allow_module_level=True)

from freetoken.engine.core import EngineCore
from freetoken.engine.graph_runner import DecodeRow
from freetoken.models.loader import load_model
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import load_config
from tests.kernels.triton.engine.inventory import Ops, count_triton, cuda_path
from tests.models.fixtures import hf_reference


def _runner_logits(model_dir, seqs: list[list[int]], fast: bool, attention: str | None = None,
                   mode: Ops | None = None) -> torch.Tensor:
    model = load_model(model_dir, dtype=torch.float32, progress=False)
    core = EngineCore(model, [2], kv_tokens=256, state_slots=8, max_running=4,
                      decode_runner=True)
    runner = core.runner
    assert runner.attention == "torch"  # MLA: the runner plans no GQA kernel over latents
    if attention is not None:
        runner.attention = attention
    rows = []
    for b, s in enumerate(seqs):
        slots = torch.arange(60 * b, 60 * b + len(s))
        model(ForwardBatch.single(s[:-1], 0, slots[:-1], b), core.caches)
        rows.append(DecodeRow(token=s[-1], position=len(s) - 1, out_slot=int(slots[-1]),
                              state_slot=b, kv_slots=slots))
    logits: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda m, a, out: logits.append(out.clone()))
    undo = cuda_path() if fast else None
    try:
        if mode is None:
            runner.step(rows)
        else:
            with mode, count_triton(mode):
                runner.step(rows)
    finally:
        hook.remove()
        if undo is not None:
            undo()
    return logits[-1][: len(seqs)]  # [B, V]; not a bucket's padding rows


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_linear"])
def test_runner_decode_matches_transformers_on_both_paths(tiny_hf, kind: str) -> None:
    d = tiny_hf(kind)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 512, (9 + 4 * b,), generator=g).tolist() for b in range(3)]
    ref = hf_reference(d)
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in seqs])  # [B, V]
    assert ((_runner_logits(d, seqs, False) - want).norm() / want.norm()).item() < 1e-5
    mode = Ops()
    got = _runner_logits(d, seqs, True, mode=mode)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    kernels = {name for (_, name) in mode.ops if name.startswith("triton:")}
    assert {"triton:_combine_kernel", "triton:_decode_gate_up_kernel"} <= kernels, kernels
    if kind == "kimi_linear":  # KDA's decode step in place on the state pool
        assert {"triton:_kda_recurrent_kernel", "triton:_conv_update_kernel"} <= kernels
    # the CUDA runner's MLA plan: absorbed attention over the latent pool in one Triton kernel
    mode = Ops()
    got = _runner_logits(d, seqs, True, attention="triton_mla", mode=mode)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    mla_layers = len(load_config(d).full_attention_layers)
    assert mode.ops[("step", "triton:_mla_split_kernel")] == mla_layers, mode.ops


def test_runner_glm_sparse_decode_matches_transformers(tiny_hf) -> None:
    """GLM-5 through the runner: on the torch plan each row's indexer picks its latents from
    the runner's slot lists; on the CUDA plan (interpreted) the pick runs on the device over the
    step's CSR and the MLA kernel reads the picked CSR. Contexts are longer than index_topk
    (24), so the pick matters; the shared layers reuse it."""
    d = tiny_hf("glm_moe_dsa")
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 512, (30 + 9 * b,), generator=g).tolist() for b in range(2)]
    seqs.append(seqs[0][:12])  # a row shorter than index_topk: every latent
    ref = hf_reference(d)
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in seqs])
    assert ((_runner_logits(d, seqs, False) - want).norm() / want.norm()).item() < 1e-5
    mode = Ops()
    got = _runner_logits(d, seqs, False, attention="triton_mla", mode=mode)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert mode.ops[("step", "triton:_mla_split_kernel")] == 4, mode.ops


def test_runner_refuses_a_gqa_plan_over_latents(tiny_hf) -> None:
    with pytest.raises(NotImplementedError, match="MLA decode"):
        _runner_logits(tiny_hf("deepseek_v3"), [[5, 6, 7]], False, attention="triton")
