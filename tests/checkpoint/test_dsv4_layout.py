"""DeepSeek-V4's checkpoint layout (checkpoint/layout_dsv4.py) against transformers 5.25's
DeepseekV4ForCausalLM built from the same config: the tensor names and shapes, the float32 set,
and the three disk namings the reader takes (transformers' own, what `save_pretrained` writes,
DeepSeek's released names), each read back to the values transformers holds."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from freetoken.bench.checkpoint_writer import released_config
from freetoken.checkpoint.layout import expected_runtime, expected_tensors, fp32_tensors
from freetoken.checkpoint.layout_dsv4 import canonical_name, released_name
from freetoken.checkpoint.safetensors_reader import CheckpointError, load_checkpoint
from freetoken.types.model_config import config_from_dict, load_config
from freetoken.types.presets import SHAPES, preset_config

transformers = pytest.importorskip("transformers")

SHAPE = "tiny-deepseek-v4"


def _config(vocab: int = 512) -> dict:
    """The tiny preset's config.json at a small vocab (fast), as the writer spells it."""
    return dict(released_config(SHAPE, None), vocab_size=vocab)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM(DeepseekV4Config(**_config()))
    with torch.no_grad():  # distinct values everywhere (transformers zeroes some at init)
        for t in m.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t))
            else:
                t.copy_(torch.randint(0, 8, t.shape))
    return m.eval()


def _shapes(sd: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in sd.items()}


def test_layout_is_transformers_state_dict(hf_model) -> None:
    cfg = config_from_dict(_config())
    sd = _shapes(hf_model.state_dict())
    assert expected_runtime(cfg) == sd  # fused banks, every name and shape
    per_expert = expected_tensors(cfg)
    assert {k for k in per_expert if ".experts." not in k} == {k for k in sd
                                                               if ".experts." not in k}
    assert sum(".experts." in k for k in per_expert) == 4 * 8 * 3  # 4 layers, 8 experts
    kinds = {i: t for i, t in enumerate(cfg.dsv4.kinds)}
    assert kinds == {0: "sliding", 1: "csa", 2: "hca", 3: "csa"}
    assert "model.layers.0.mlp.gate.tid2eid" in sd and "model.layers.2.mlp.gate.tid2eid" not in sd


def test_fp32_set_is_what_transformers_keeps_in_fp32(tmp_path: Path, hf_model) -> None:
    from transformers import DeepseekV4ForCausalLM

    hf_model.save_pretrained(tmp_path / "s")
    m = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "s", dtype=torch.bfloat16)
    kept = {k for k, v in m.state_dict().items() if v.dtype == torch.float32}
    cfg = config_from_dict(_config())
    assert fp32_tensors(cfg) == kept
    assert {k for k, v in m.state_dict().items() if v.dtype == torch.int64} == {
        "model.layers.0.mlp.gate.tid2eid", "model.layers.1.mlp.gate.tid2eid"}


def _released(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", k)
        if m is None:
            out[released_name(k)] = v.clone()
            continue
        p = f"model.layers.{m[1]}.mlp.experts."
        for e in range(v.shape[0]):
            if m[2] == "down_proj":
                out[released_name(f"{p}{e}.down_proj.weight")] = v[e].clone()
            else:
                gate, up = v[e].chunk(2)
                out[released_name(f"{p}{e}.gate_proj.weight")] = gate.clone()
                out[released_name(f"{p}{e}.up_proj.weight")] = up.clone()
    out["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)  # multi-token prediction: skipped
    return out


@pytest.mark.parametrize("naming", ["hf", "saved", "released"])
def test_reader_takes_each_naming(tmp_path: Path, hf_model, naming: str) -> None:
    d = tmp_path / naming
    if naming == "saved":  # save_pretrained's default: transformers reverts its mapping
        hf_model.save_pretrained(d)
    else:
        d.mkdir()
        sd = hf_model.state_dict()
        save_file(sd if naming == "hf" else _released(sd), str(d / "model.safetensors"),
                  metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(_config()))
    cfg = load_config(d)
    got = load_checkpoint(d, cfg, dtype=torch.bfloat16, progress=False)
    want = hf_model.state_dict()
    assert set(got) == set(want)
    fp32 = fp32_tensors(cfg)
    for k, v in want.items():
        if k.endswith("tid2eid"):
            assert got[k].dtype == torch.int64 and torch.equal(got[k], v), k
            continue
        assert got[k].dtype == (torch.float32 if k in fp32 else torch.bfloat16), k
        tol = 0 if k in fp32 else 1e-2
        torch.testing.assert_close(got[k].float(), v.float(), rtol=tol, atol=tol, msg=k)


def test_names_round_trip_and_mismatches_are_refused(tmp_path: Path) -> None:
    cfg = config_from_dict(_config())
    for n in expected_tensors(cfg):
        ds = released_name(n)
        assert canonical_name(ds) == n and canonical_name("model." + ds) == canonical_name(n)
    assert released_name("model.layers.3.self_attn.compressor.indexer.kv_norm.weight") == \
        "layers.3.attn.indexer.compressor.norm.weight"
    assert canonical_name("layers.2.ffn.gate.bias") == \
        "model.layers.2.mlp.gate.e_score_correction_bias"
    assert canonical_name("mtp.0.norm.weight") == "mtp.0.norm.weight"
    # a tensor of the wrong shape is named with both shapes before any data is read
    d = tmp_path / "bad"
    d.mkdir()
    sd = {k: torch.zeros(s) for k, s in expected_tensors(cfg).items()}
    sd["model.layers.2.self_attn.compressor.position_bias"] = torch.zeros(4, 32)  # rate 8
    save_file(_released(sd), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(_config()))
    with pytest.raises(CheckpointError, match=r"compressor\.position_bias.*\[8, 32\].*\[4, 32\]"):
        load_checkpoint(d, cfg, dtype=torch.float32, progress=False)
    # the same tensor under two namings
    sd2 = _released({k: v for k, v in sd.items() if "position_bias" not in k})
    sd2["model.norm.weight"] = torch.zeros(64)
    save_file(sd2, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight is stored twice"):
        load_checkpoint(d, cfg, dtype=torch.float32, progress=False)


@pytest.mark.parametrize("shape", ["deepseek-v4-flash", "tiny-deepseek-v4"])
def test_preset_config_round_trips_through_the_parser(shape: str) -> None:
    """The written config.json parses to the preset's config, and transformers reads the same
    schedules from it."""
    from transformers import DeepseekV4Config

    raw = released_config(shape, None)
    assert config_from_dict(raw) == preset_config(shape)
    hf = DeepseekV4Config(**{k: v for k, v in raw.items() if k != "architectures"})
    cfg = preset_config(shape)
    kinds = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
             "heavily_compressed_attention": "hca"}
    assert tuple(kinds[t] for t in hf.layer_types) == cfg.dsv4.kinds
    assert tuple(i for i, t in enumerate(hf.mlp_layer_types) if t == "hash_moe") == \
        cfg.dsv4.hash_layers
    assert (hf.hidden_size, hf.num_hidden_layers, hf.n_routed_experts, hf.vocab_size) == (
        cfg.hidden_size, cfg.num_layers, cfg.num_experts, cfg.vocab_size)
    cut = preset_config(shape, layers=2)
    assert cut.num_layers == 2 and cut.dsv4.kinds == cfg.dsv4.kinds[:2]


def test_flash_preset_is_transformers_defaults() -> None:
    from transformers import DeepseekV4Config

    d = DeepseekV4Config()
    raw = SHAPES["deepseek-v4-flash"]
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "head_dim", "q_lora_rank", "moe_intermediate_size", "n_routed_experts",
              "num_experts_per_tok", "o_groups", "o_lora_rank", "index_n_heads",
              "index_head_dim", "index_topk", "sliding_window", "hc_mult", "compress_rates",
              "partial_rotary_factor", "routed_scaling_factor", "swiglu_limit"):
        assert raw[k] == getattr(d, k), k
    assert preset_config("deepseek-v4-flash") == config_from_dict({"model_type": "deepseek_v4"})
