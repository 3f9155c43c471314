"""Every expert backend against `fused` on DeepSeek-V3, Kimi-Linear and GLM-5 (group-limited
routing, ungated shared experts, dense first layers; Kimi's MoE under `block_sparse_moe`):
bit-identical fp32 logits on CPU, prefill then decode. The block hands the backends routed ids
the way the softmax MoEBlock does; a block that bypassed the backend, or that fed it ids of the
dense layers, would differ here or fail to load."""
from __future__ import annotations

import pytest
import torch

from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.cli.build import load_with_experts
from freetoken.models.loader import load_model
from freetoken.types.config import MoEConfig
from freetoken.types.forward_batch import ForwardBatch


def _logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.cfg
    c = Caches(KVPool(cfg, 128, torch.float32, "cpu"),
               StateTensors(cfg, 1, torch.float32, "cpu") if cfg.has_linear_attention else None)
    out = [model(ForwardBatch.single(ids[:40], 0, torch.arange(40), 0, all_logits=True), c)]
    for t in range(40, len(ids)):
        out.append(model(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), 0), c))
    return torch.cat(out)


@pytest.mark.parametrize("backend,slots", [("offload", 3), ("offload", 12), ("cpu", 5),
                                           ("hybrid", 2), ("hybrid", 9), ("auto", 10)])
@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_linear", "glm_moe_dsa"])
def test_backend_bit_identical_to_fused(tiny_hf, kind: str, backend: str, slots: int) -> None:
    d = tiny_hf(kind)
    fused = load_model(d, dtype=torch.float32, progress=False)
    ids = torch.randint(0, fused.cfg.vocab_size, (56,),
                        generator=torch.Generator().manual_seed(7)).tolist()
    want = _logits(fused, ids)
    m, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=slots),
                              dtype=torch.float32, progress=False)
    assert rt.store.num_layers == len(fused.cfg.moe_layers) >= 2
    got = _logits(m, ids)
    assert torch.equal(got, want)
    st = rt.counters.as_dict()
    assert st["misses"] > 0
    if backend in ("cpu", "hybrid"):
        assert st["cpu_experts"] > 0
    if backend in ("offload", "hybrid"):
        assert st["fetched"] > 0
