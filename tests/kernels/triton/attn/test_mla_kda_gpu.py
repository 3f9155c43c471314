"""The MLA and KDA decode kernels on the H200 (issue 26): the runner plans `triton_mla` for
DeepSeek-V3 and Kimi-Linear, captures CUDA graphs and replays them, and its greedy tokens equal
transformers' (fp32) with every expert backend; GLM-5 too, its indexer picking each row's
latents on the device inside the graph; the kernels alone at DeepSeek-V3's latent shape
(C 512 + R 64, 128 heads, bf16) and Kimi-Linear's KDA shape (32 heads × 128) against the torch
paths.

    TRITON_CACHE_DIR=... python -m pytest -q tests/kernels/triton/attn/test_mla_kda_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.types.config import MoEConfig
from tests.engine.drive import greedy_tokens
from tests.models.family_helpers import hf_greedy, prompt
from tests.models.fixtures import hf_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["fused", "offload", "hybrid"])
@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_linear", "glm_moe_dsa"])
def test_graphs_equal_transformers(tiny_hf, kind: str, backend: str) -> None:
    d = tiny_hf(kind)
    moe = None if backend == "fused" else MoEConfig(backend=backend, cache_size=6,
                                                     measure_bw=False)
    model, rt = load_with_experts(d, moe, dtype=torch.float32, device="cuda", progress=False)
    ref = hf_reference(d)
    prompts = [prompt(model.cfg.vocab_size, 40 + 9 * i, seed=i) for i in range(3)]
    got, core = greedy_tokens(model, prompts, 24, decode_runner=True, cuda_graph=True, moe=rt)
    assert got == [hf_greedy(ref, p, 24) for p in prompts]
    # GLM-5 (index_topk 24 < these contexts): its indexer picks on the device in the graph
    assert core.runner.attention == "triton_mla" and core.runner.use_graphs
    assert core.runner.replays > 0


def test_mla_kernel_at_deepseek_shape() -> None:
    from freetoken.kernels.triton.mla_decode import mla_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    B, hq, c, r, S = 4, 128, 512, 64, 40_000
    pool = torch.randn(S, 1, c + r, device="cuda", generator=g).bfloat16()
    q = torch.randn(B, hq, c + r, device="cuda", generator=g).bfloat16()
    lens = [1, 300, 4096, 17_000]
    perm = torch.randperm(S, device="cuda", generator=g)
    rows = [perm[sum(lens[:b]):sum(lens[:b + 1])] for b in range(B)]
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
    indices = torch.cat(rows).to(torch.int32)
    scale = (192 ** -0.5)
    got = mla_decode_attention(q, pool, indptr, indices, scale, c).float()
    for b, slots in enumerate(rows):
        lat = pool[slots, 0].float()  # [L, C+R]
        want = torch.softmax(q[b].float() @ lat.T * scale, -1) @ lat[:, :c]
        assert ((got[b] - want).norm() / want.norm()).item() < 2e-2, b


def test_kda_kernel_at_kimi_shape() -> None:
    from freetoken.kernels.triton.kda import kda_recurrent_pool
    from freetoken.layers.kda_rule import recurrent_kda

    g = torch.Generator(device="cuda").manual_seed(1)
    B, H, K, V, S = 8, 32, 128, 128, 20

    def l2(x):
        return x / x.norm(dim=-1, keepdim=True)

    q = l2(torch.randn(B, H, K, device="cuda", generator=g))
    k = l2(torch.randn(B, H, K, device="cuda", generator=g))
    v = torch.randn(B, H, V, device="cuda", generator=g).bfloat16()
    gate = -torch.rand(B, H, K, device="cuda", generator=g)
    beta = torch.rand(B, H, device="cuda", generator=g).bfloat16()
    pool = torch.randn(S, H, K, V, device="cuda", generator=g)
    slots = torch.arange(S - B, S, device="cuda")
    want_o, want_s = recurrent_kda(q, k, v, gate, beta, pool[slots])
    o = kda_recurrent_pool(q, k, v, gate, beta, pool, slots)
    assert (o - want_o).abs().max().item() < 1e-4
    assert (pool[slots] - want_s).abs().max().item() < 1e-4
