"""On the GPU: the Triton fused MoE with gpt-oss's experts (biases by logical id, clamped
SwiGLU: the ACT 1 epilogues) at the gpt-oss-20b expert shape (bf16 banks, H = I = 2880,
32 experts, top-4) against the float64 oracle, CUDA-graph capture of the decode path with an
act, and the tiny gpt-oss model's greedy tokens through the Triton path equal to the torch
path's. The CPU runs the same kernels interpreted in tests/kernels/triton/moe/
test_fused_moe_act.py and tests/kernels/triton/engine/test_gpt_oss_cuda_path.py."""
from __future__ import annotations

import pytest
import torch

from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.reference import expert_ffn_reference
from freetoken.kernels.triton.fused_moe import fused_moe

pytestmark = pytest.mark.gpu

H, I, E, K = 2880, 2880, 32, 4


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
    gub = torch.randn(E, 2 * I, device="cuda", generator=g).bfloat16()
    db = torch.randn(E, H, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(E, device="cuda", generator=g)  # logical expert -> bank row (slots)
    return gate_up, down, ExpertAct(1.702, 7.0, gub, db), perm


def _route(T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lid = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=-1).indices  # [T, K]
    return lid


def _check(y, want, tol):
    per = (y.double().cpu() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    assert per.max() < tol, f"worst entry relative error {per.max():.2e}"


@pytest.mark.parametrize("T,decode,tol", [(1, True, 1e-2), (4, True, 1e-2), (40, False, 3e-2)])
def test_act_matches_float64(experts, T, decode, tol):
    gate_up, down, act, perm = experts
    lid = _route(T, T)
    x = torch.randn(T, H, device="cuda").bfloat16()
    rows = perm[lid]  # [T, K] bank rows; the biases follow lid
    a = act.bind(lid)
    y = torch.empty(T, K, H, dtype=torch.bfloat16, device="cuda")
    fused_moe(x, rows, gate_up, down, y, decode=decode, zero_missing=True, act=a)
    want = expert_ffn_reference(x.cpu(), rows.cpu(), gate_up.cpu(), down.cpu(), act=ExpertAct(
        a.alpha, a.limit, a.gate_up_bias.cpu(), a.down_bias.cpu(), lid.cpu()))
    _check(y, want, tol)


def test_act_decode_captures(experts):
    gate_up, down, act, perm = experts
    lid = _route(2, 7)
    x = torch.randn(2, H, device="cuda").bfloat16()
    rows, a = perm[lid], act.bind(lid)
    y = torch.empty(2, K, H, dtype=torch.bfloat16, device="cuda")
    fused_moe(x, rows, gate_up, down, y, decode=True, zero_missing=True, act=a)  # compile
    eager = y.clone()
    y.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, rows, gate_up, down, y, decode=True, zero_missing=True, act=a)
    new = _route(2, 8)
    lid.copy_(new)  # a.ids views lid: the replay reads the new routing
    rows.copy_(perm[new])
    graph.replay()
    torch.cuda.synchronize()
    y2 = torch.empty_like(y)
    fused_moe(x, rows, gate_up, down, y2, decode=True, zero_missing=True, act=a)
    assert torch.equal(y, y2) and not torch.equal(y, eager)


@pytest.mark.parametrize("backend", ["fused", "offload", "hybrid"])
def test_tiny_gpt_oss_triton_equals_torch(tmp_path, monkeypatch, backend):
    """Greedy tokens of a 70-token prompt (K = 2: its prefill is 140 entries, the grouped path)
    and 24 decode steps (the GEMV path), Triton experts against the torch experts."""
    from freetoken.cli.build import load_with_experts
    from freetoken.engine.generate import generate
    from freetoken.kernels import dispatch
    from freetoken.types.api import SamplingParams
    from freetoken.types.config import MoEConfig
    from tests.models.fixtures_gpt_oss import build_gpt_oss

    d = build_gpt_oss(tmp_path)
    ids = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(7)).tolist()
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def tokens():
        m, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=5),
                                  dtype=torch.float32, device="cuda", progress=False)
        return generate(m, ids, sp, [], moe=rt).token_ids

    triton_path = tokens()
    orig = dispatch.triton_for
    monkeypatch.setattr(dispatch, "triton_for",
                        lambda x, name: None if name == "fused_moe" else orig(x, name))
    assert triton_path == tokens()
