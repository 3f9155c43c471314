"""On the GPU: the Triton fused MoE with DeepSeek-V4's experts (ExpertAct kind "clamp":
silu(min(g, limit)) * clamp(u, ±limit), no biases: the ACT 2 epilogues) on bf16 banks at an
expert shape of V4's size class (H = 4096, I = 2048, 32 bank rows, top-6) against the float64
oracle, the MXFP4 twins likewise, and CUDA-graph capture of the decode path with the act. The
pre-activations are scaled so that a good share of gate and up lie past ±limit. The CPU runs
the same kernels interpreted in tests/kernels/triton/moe/test_fused_moe_clamp.py."""
from __future__ import annotations

import pytest
import torch

from freetoken.kernels.expert_act import ExpertAct
from freetoken.kernels.reference import expert_ffn_reference
from freetoken.kernels.triton.fused_moe import fused_moe

pytestmark = pytest.mark.gpu

H, I, S, K = 4096, 2048, 32, 6
LIMIT = 10.0
CLAMP = ExpertAct.clamp(LIMIT)


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator(device="cuda").manual_seed(0)
    # gate / up pre-activations std ~16 on unit x: about 27% past each side of ±10 (std 12
    # gave 20%, which the 0.2 floor below missed by a hair on the H200, session 19)
    gate_up = (torch.randn(S, 2 * I, H, device="cuda", generator=g) * (16.0 / H**0.5)).bfloat16()
    down = (torch.randn(S, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
    return gate_up, down


def _route(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(T, S, device="cuda", generator=g).topk(K, dim=-1).indices  # [T, K]


def _check(y, want, tol):
    per = (y.double().cpu() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    assert per.max() < tol, f"worst entry relative error {per.max():.2e}"


def _clamps_bite(x, rows, gate_up) -> None:
    pre = torch.einsum("h,krh->kr", x[0].float(), gate_up[rows[0]].float())  # the first token
    g, u = pre[..., :I], pre[..., I:]
    for side in (g > LIMIT, g < -LIMIT, u > LIMIT, u < -LIMIT):
        assert side.float().mean() > 0.2


@pytest.mark.parametrize("T,decode,tol", [(1, True, 1e-2), (4, True, 1e-2), (24, False, 3e-2)])
def test_clamp_matches_float64(experts, T, decode, tol):
    gate_up, down = experts
    rows = _route(T, T)
    x = torch.randn(T, H, device="cuda").bfloat16()
    _clamps_bite(x, rows, gate_up)
    y = torch.empty(T, K, H, dtype=torch.bfloat16, device="cuda")
    fused_moe(x, rows, gate_up, down, y, decode=decode, zero_missing=True,
              act=CLAMP.bind(rows))
    # (the banks stay on the device: the oracle copies the routed rows only)
    want = expert_ffn_reference(x, rows, gate_up, down, act=CLAMP)
    _check(y, want, tol)
    plain = expert_ffn_reference(x, rows, gate_up, down)
    with pytest.raises(AssertionError):  # the clamp matters at this tolerance
        _check(y, plain, tol)


@pytest.mark.parametrize("T,decode", [(2, True), (24, False)])
def test_clamp_mxfp4_matches_float64(experts, T, decode):
    from freetoken.kernels.quant import quantize_bank
    from freetoken.kernels.triton.moe_quant import fused_moe_quant_decode
    from freetoken.kernels.triton.moe_quant_grouped import fused_moe_quant_grouped

    gate_up, down = experts
    qgu = quantize_bank(gate_up[:8].float(), "mxfp4", 32, 2).to("cuda")
    qdn = quantize_bank(down[:8].float(), "mxfp4", 32, 1).to("cuda")
    rows = _route(T, 100 + T) % 8
    x = torch.randn(T, H, device="cuda").bfloat16()
    y = torch.empty(T, K, H, dtype=torch.bfloat16, device="cuda")
    if decode:
        fused_moe_quant_decode(x, rows, qgu, qdn, y, zero_missing=True, act=CLAMP)
    else:
        y.zero_()
        fused_moe_quant_grouped(x, rows, qgu, qdn, y, act=CLAMP)
    want = expert_ffn_reference(x, rows, qgu, qdn, act=CLAMP)
    _check(y, want, 3e-2)


def test_clamp_decode_captures(experts):
    gate_up, down = experts
    rows = _route(2, 7)
    x = torch.randn(2, H, device="cuda").bfloat16()
    y = torch.empty(2, K, H, dtype=torch.bfloat16, device="cuda")
    fused_moe(x, rows, gate_up, down, y, decode=True, zero_missing=True, act=CLAMP)  # compile
    eager = y.clone()
    y.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, rows, gate_up, down, y, decode=True, zero_missing=True, act=CLAMP)
    rows.copy_(_route(2, 8))
    graph.replay()
    torch.cuda.synchronize()
    y2 = torch.empty_like(y)
    fused_moe(x, rows, gate_up, down, y2, decode=True, zero_missing=True, act=CLAMP)
    assert torch.equal(y, y2) and not torch.equal(y, eager)
