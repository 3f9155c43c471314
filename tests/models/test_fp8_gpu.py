"""On the GPU (issue 25): an FP8 Qwen3.6 checkpoint (tests/models/test_fp8_vs_hf.py writes it)
runs through every backend on CUDA — the quantized Triton decode and grouped kernels, FP8 slots
filled over the link, the CPU kernel on the hybrid branch — with fp32 logits close to the CPU
run's, and offload's greedy tokens those of fused (same kernels over the same bytes)."""
from __future__ import annotations

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig
from tests.experts.test_moe_backends import _logits
from tests.models.test_fp8_vs_hf import _write_fp8

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp8_dir(tiny_hf, tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8-gpu")
    _write_fp8(tiny_hf("qwen3_5_moe"), base / "ckpt", base / "dequantized", 128)
    return base / "ckpt"


def _gpu_logits(model, ids):
    from freetoken.cache.tensors import Caches, KVPool, StateTensors
    from freetoken.types.forward_batch import ForwardBatch

    cfg = model.cfg
    c = Caches(KVPool(cfg, 128, torch.float32, "cuda"), StateTensors(cfg, 1, torch.float32, "cuda"))
    out = [model(ForwardBatch.single(ids[:40], 0, torch.arange(40), 0, "cuda",
                                     all_logits=True), c)]
    for t in range(40, len(ids)):
        out.append(model(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), 0, "cuda"), c))
    return torch.cat(out).float().cpu()


@pytest.mark.parametrize("backend", ["fused", "offload", "hybrid", "cpu"])
def test_fp8_backends_on_gpu(fp8_dir, backend: str) -> None:
    ids = torch.randint(0, 512, (56,), generator=torch.Generator().manual_seed(7)).tolist()
    want = _logits(load_model(fp8_dir, dtype=torch.float32, progress=False), ids)  # CPU
    if backend == "fused":
        m, rt = load_model(fp8_dir, dtype=torch.float32, device="cuda", progress=False), None
    else:
        m, rt = load_with_experts(fp8_dir, MoEConfig(backend=backend, cache_size=6),
                                  dtype=torch.float32, device="cuda", progress=False)
    got = _gpu_logits(m, ids)
    assert (got - want).abs().max().item() < 1e-3 * max(1.0, want.abs().max().item())
    if backend == "offload":
        sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        fused = load_model(fp8_dir, dtype=torch.float32, device="cuda", progress=False)
        assert (generate(m, ids[:20], sp, [], moe=rt).token_ids
                == generate(fused, ids[:20], sp, []).token_ids)
