"""gpt-oss (`gpt_oss`, issue 25 item 1) against transformers' GptOssForCausalLM on tiny random
checkpoints (tests/models/fixtures_gpt_oss.py): dense fp32 and MXFP4 as released (the oracle
runs transformers' own dequantization of the blocks). fp32 logits within rel 1e-5 over a
48-token prompt (40 prefilled, 8 decoded one by one: the window of 6 slides over both), the same
through chunked prefill, greedy tokens identical; every expert backend bit-identical to
`fused`; the config's spellings and refusals."""
from __future__ import annotations

import sys

sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import json
import shutil
from pathlib import Path

import pytest
import torch

from freetoken.cache.tensors import Caches, KVPool
from freetoken.cli.build import load_with_experts
from freetoken.engine.generate import generate
from freetoken.kernels.quant import QuantBank
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ConfigError, config_from_dict
from tests.experts.test_moe_backends import _logits
from tests.models.fixtures_gpt_oss import CONFIG, build_gpt_oss, gpt_oss_reference


@pytest.fixture(scope="module", params=["dense", "mxfp4"])
def ckpt(request, tmp_path_factory):
    d = build_gpt_oss(tmp_path_factory.mktemp(f"gpt-oss-{request.param}"),
                      mxfp4=request.param == "mxfp4")
    return d, gpt_oss_reference(d)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, CONFIG["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), err


def test_config_fields(ckpt) -> None:
    d, _ = ckpt
    cfg = config_from_dict(json.loads((d / "config.json").read_text()))
    assert cfg.sliding_layers == (0, 2) and cfg.sliding_window == 6
    assert cfg.layer_types == ("full_attention",) * 4  # every layer keeps its KV in the pool
    assert cfg.attention_sinks and cfg.expert_act == "swiglu_oai"
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert dict(cfg.rope_scaling)["rope_type"] == "yarn" and cfg.rope_theta == 150000.0
    assert cfg.num_experts == 8 and cfg.top_k == 2 and cfg.moe_intermediate_size == 64


def test_logits_match_transformers(ckpt) -> None:
    d, ref = ckpt
    ours = load_model(d, dtype=torch.float32, progress=False)
    ids = _ids(48, 3)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # [T, V]
    _close(_logits(ours, ids), want)  # 40-token prefill + 8 decode rows
    # chunked prefill: 3 chunks over a cached prefix (the window crosses chunk borders)
    c = Caches(KVPool(ours.cfg, 64, torch.float32, "cpu"), None)
    outs = []
    for lo, hi in ((0, 7), (7, 30), (30, 48)):
        b = ForwardBatch.single(ids[lo:hi], lo, torch.arange(hi), None, all_logits=True)
        outs.append(ours(b, c))
    _close(torch.cat(outs), want)


def test_greedy_matches_transformers(ckpt) -> None:
    d, ref = ckpt
    ours = load_model(d, dtype=torch.float32, progress=False)
    prompt = _ids(12, 5)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    got = generate(ours, prompt, SamplingParams(max_tokens=14, temperature=0.0), eos_ids=[])
    assert got.token_ids == want


def test_mxfp4_experts_stay_quantized(ckpt) -> None:
    d, _ = ckpt
    m = load_model(d, dtype=torch.float32, progress=False)
    gu = m.moe_blocks()[0].experts.gate_up_proj
    if m.cfg.expert_format == torch.float32:
        assert gu.shape == (8, 128, 64)
        return
    assert isinstance(gu, QuantBank) and gu.fmt == "mxfp4" and gu.data.dtype == torch.uint8
    # H=64, I=64: 3 matrices of 4096 values, half a byte each + one byte per 32
    assert m.cfg.expert_bytes() == gu[0].nbytes + m.moe_blocks()[0].experts.down_proj[0].nbytes
    assert m.cfg.expert_bytes() == 3 * 4096 // 2 + 3 * 4096 // 32


@pytest.mark.parametrize("backend,slots", [("offload", 3), ("cpu", 5), ("hybrid", 4),
                                           ("auto", 10)])
def test_backends_bit_identical_to_fused(ckpt, backend: str, slots: int) -> None:
    d, _ = ckpt
    fused = load_model(d, dtype=torch.float32, progress=False)
    ids = _ids(52, 7)
    want = _logits(fused, ids)
    m, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=slots),
                              dtype=torch.float32, progress=False)
    assert all(a is not None for a in rt.acts)  # the CPU branch's host copies of the biases
    assert torch.equal(_logits(m, ids), want)
    assert rt.counters.as_dict()["misses"] > 0


def test_refusals(tmp_path: Path, ckpt) -> None:
    d, _ = ckpt
    raw = json.loads((d / "config.json").read_text())
    with pytest.raises(ConfigError, match="quant_method"):
        config_from_dict({**raw, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_dict({**raw, "layer_types": ["linear_attention"] * 4})
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    from safetensors.torch import load_file, save_file

    from freetoken.checkpoint.safetensors_reader import CheckpointError

    st = load_file(str(bad / "model.safetensors"))
    st.pop("model.layers.1.self_attn.sinks")
    save_file(st, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="self_attn.sinks"):
        load_model(bad, dtype=torch.float32, progress=False)
