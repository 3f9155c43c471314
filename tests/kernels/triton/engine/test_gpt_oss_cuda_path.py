"""gpt-oss's experts on the CUDA code path, interpreted on CPU tensors: with every kernel switch
pointed at Triton (inventory.cuda_path), the fused, offload and hybrid backends compute the
biased, clamped-SwiGLU experts in the Triton fused MoE (decode GEMV and grouped paths, ACT 1
epilogues; asserted by counting the launches), and their greedy tokens equal the torch path's
on the tiny gpt-oss model: dense fp32 banks on every backend, and the MXFP4 checkpoint (the
quantized twins, moe_quant.py / moe_quant_grouped.py) on fused and hybrid."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import collections

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("interprets the CUDA path on CPU tensors; test_gpt_oss_moe_gpu.py "
                "runs it for real",
                allow_module_level=True)

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.types.api import GenerateRequest, SamplingParams
from freetoken.types.config import MoEConfig
from tests.engine.test_decode_runner import _prompt, _run
from tests.kernels.triton.engine.inventory import cuda_path
from tests.models.fixtures_gpt_oss import build_gpt_oss

KERNELS = ("_decode_gate_up_kernel", "_decode_down_kernel", "_grouped_gate_up_kernel",
           "_grouped_down_kernel", "_q_gate_up_kernel", "_q_down_kernel", "_qg_gate_up_kernel",
           "_qg_down_kernel")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt-oss-cuda-path"))


@pytest.fixture(scope="module")
def mx_ckpt(tmp_path_factory):
    return build_gpt_oss(tmp_path_factory.mktemp("gpt-oss-cuda-path-mx"), mxfp4=True)


def _reqs(V: int) -> list[GenerateRequest]:
    # K = 2: a 70-token prefill chunk is 140 entries, past DECODE_MAX_ENTRIES (grouped path)
    prompts = [_prompt(V, 70, 0), _prompt(V, 11, 1)]
    return [GenerateRequest(p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                            request_id=f"g{i}") for i, p in enumerate(prompts)]


def _tokens(d, backend: str, triton: bool) -> tuple[dict, collections.Counter]:
    from triton.runtime.interpreter import InterpretedFunction

    model, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=5),
                                  dtype=torch.float32, progress=False)
    launches: collections.Counter = collections.Counter()
    orig = InterpretedFunction.run

    def run(self, *args, **kwargs):
        if self.fn.__name__ in KERNELS:
            launches[(self.fn.__name__, kwargs.get("ACT"))] += 1
        return orig(self, *args, **kwargs)

    undo = cuda_path() if triton else (lambda: None)
    InterpretedFunction.run = run
    try:
        core = EngineCore(model, [2], kv_tokens=256, state_slots=4, max_running=4,
                          chunk_tokens=96, decode_runner=False, moe=rt)
        return _run(core, _reqs(model.cfg.vocab_size)), launches
    finally:
        InterpretedFunction.run = orig
        undo()


@pytest.mark.parametrize("backend", ["fused", "offload", "hybrid"])
def test_triton_experts_equal_torch_path(ckpt, backend: str) -> None:
    want, none = _tokens(ckpt, backend, triton=False)
    assert not none  # the torch path launches no MoE kernel
    got, launches = _tokens(ckpt, backend, triton=True)
    assert got == want
    assert launches[("_decode_gate_up_kernel", 1)] > 0, launches  # decode steps
    assert launches[("_grouped_gate_up_kernel", 1)] > 0, launches  # the prompts' prefill
    assert all(code == 1 for _, code in launches), launches  # every launch had gpt-oss's act


# the interpreted MXFP4 decode is slow: hybrid (slot rows apart from the logical ids) always,
# fused under -m slow (the kernels' act itself: tests/kernels/triton/moe/test_fused_moe_act.py)
@pytest.mark.parametrize("backend", ["hybrid", pytest.param("fused", marks=pytest.mark.slow)])
def test_triton_mxfp4_experts_equal_torch_path(mx_ckpt, backend: str) -> None:
    want, _ = _tokens(mx_ckpt, backend, triton=False)
    got, launches = _tokens(mx_ckpt, backend, triton=True)
    assert got == want
    assert launches[("_q_gate_up_kernel", 1)] > 0, launches
    assert launches[("_qg_gate_up_kernel", 1)] > 0, launches
    assert all(code == 1 for _, code in launches), launches
