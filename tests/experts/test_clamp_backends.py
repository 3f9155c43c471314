"""Every expert backend with DeepSeek-V4's experts (ExpertAct kind "clamp", no biases;
freetoken/kernels/expert_act.py) against `fused`: bit-identical fp32 logits on the CPU, prefill
then decode, and the decode runner's captured steps (the CPU share through the bridge's worker,
which reads the runtime's host copy of the act) equal to eager steps.

The model is the tiny Qwen3-MoE with a clamp act put on its MoE blocks by the test (the
DeepSeek-V4 model is written elsewhere): each block gets an `expert_act()` returning a plain
object with the fields a model's block exposes (kind="clamp", limit, alpha, biases None: what
`MoERuntime.install` copies), and its backend is wrapped to pass the act bound to the routed
ids, as gpt-oss's block does. The limit is small against the model's pre-activations, so the
clamp changes the logits (checked: the test can fail)."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from freetoken.cli.build import load_with_experts
from freetoken.experts.runtime import host_act
from freetoken.kernels.expert_act import ExpertAct
from freetoken.layers.moe import MoEBlock
from freetoken.models.loader import load_model
from freetoken.types.config import MoEConfig
from tests.experts.test_moe_backends import _logits

LIMIT = 0.05
KIND = "qwen3_moe"


def _block_act() -> types.SimpleNamespace:
    """What a DeepSeek-V4 MoE block's `expert_act()` returns (not an ExpertAct itself)."""
    return types.SimpleNamespace(kind="clamp", limit=LIMIT, alpha=1.0, gate_up_bias=None,
                                 down_bias=None)


class _WithAct(nn.Module):
    """A block's backend, called with the clamp act bound to the routed ids."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, topk_ids, step=None, shared=None, act=None):
        return self.inner(x, topk_ids, step, shared=shared,
                          act=ExpertAct.clamp(LIMIT).bind(topk_ids))


def _with_clamp(model) -> None:
    for b in model.moe_blocks():
        b.experts = _WithAct(b.experts)


@pytest.fixture
def clamp_blocks(monkeypatch):
    monkeypatch.setattr(MoEBlock, "expert_act", lambda self: _block_act(), raising=False)


def test_expert_act_kinds_and_host_copy() -> None:
    with pytest.raises(ValueError, match="biases"):
        ExpertAct(1.0, 1.0, None, None)  # "oai" needs its biases
    with pytest.raises(ValueError, match="biases"):
        ExpertAct(1.0, 1.0, torch.zeros(2, 4), torch.zeros(2, 3), kind="clamp")
    with pytest.raises(ValueError, match="kind"):
        ExpertAct(1.0, 1.0, None, None, kind="relu")
    a = host_act(types.SimpleNamespace(expert_act=_block_act))
    assert (a.kind, a.limit, a.gate_up_bias, a.down_bias, a.code) == ("clamp", LIMIT, None,
                                                                      None, 2)
    assert host_act(types.SimpleNamespace()) is None
    gub = torch.ones(2, 4)
    o = host_act(types.SimpleNamespace(expert_act=lambda: ExpertAct(1.7, 7.0, gub,
                                                                   torch.ones(2, 3))))
    assert o.kind == "oai" and torch.equal(o.gate_up_bias, gub) and o.gate_up_bias is not gub


@pytest.mark.parametrize("backend,slots", [("offload", 3), ("offload", 12), ("cpu", 5),
                                           ("hybrid", 2), ("hybrid", 9), ("auto", 10)])
def test_clamp_backend_bit_identical_to_fused(tiny_hf, clamp_blocks, backend: str,
                                              slots: int) -> None:
    d = tiny_hf(KIND)
    fused = load_model(d, dtype=torch.float32, progress=False)
    ids = torch.randint(0, fused.cfg.vocab_size, (64,),
                        generator=torch.Generator().manual_seed(7)).tolist()
    plain = _logits(fused, ids)
    _with_clamp(fused)
    want = _logits(fused, ids)
    assert (want - plain).abs().max() > 1e-3  # the clamp bites: a backend ignoring it differs
    m, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=slots),
                              dtype=torch.float32, progress=False)
    assert all(a is not None and a.kind == "clamp" and a.limit == LIMIT for a in rt.acts)
    _with_clamp(m)
    got = _logits(m, ids)
    assert torch.equal(got, want)
    st = rt.counters.as_dict()
    assert st["misses"] > 0
    if backend in ("cpu", "hybrid"):
        assert st["cpu_experts"] > 0
    if backend in ("offload", "hybrid"):
        assert st["fetched"] > 0


@pytest.mark.parametrize("backend", ["hybrid", "cpu"])
def test_clamp_runner_equals_eager(tiny_hf, clamp_blocks, backend: str) -> None:
    """Captured decode steps: the CPU share runs on the bridge's worker from `rt.acts` (the
    host copy install took), the Python step loop (the native loop has no act)."""
    from freetoken.engine.core import EngineCore
    from freetoken.types.api import GenerateRequest, SamplingParams
    from tests.engine.test_decode_runner import _prompt, _run

    d = tiny_hf(KIND)

    def tokens(runner: bool, clamp: bool = True) -> dict:
        model, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=5),
                                      dtype=torch.float32, progress=False)
        if clamp:
            _with_clamp(model)
        else:
            rt.acts = [None] * len(rt.acts)
        V = model.cfg.vocab_size
        reqs = [GenerateRequest(_prompt(V, 9 + 4 * i, i),
                                SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                request_id=f"c{i}") for i in range(3)]
        core = EngineCore(model, [2], kv_tokens=256, state_slots=4, max_running=4,
                          chunk_tokens=8, decode_runner=runner, moe=rt)
        out = _run(core, reqs)
        if runner:
            assert core.runner is not None and core.runner.steps > 5
        return out

    want = tokens(runner=False)
    assert tokens(runner=True) == want
    assert tokens(runner=False, clamp=False) != want  # the clamp changes the greedy tokens
