"""Checkpoint reading against transformers: names, shapes, values, layouts, errors."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from freetoken.checkpoint.layout import expected_tensors
from freetoken.checkpoint.safetensors_reader import CheckpointError, _Reader, load_checkpoint
from freetoken.types.model_config import load_config
from tests.models.conftest import TinyFactory
from tests.models.fixtures import KINDS, hf_reference


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _hf_runtime_params(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """transformers' in-memory parameters and persistent buffers (deepseek's
    e_score_correction_bias is one) under our runtime names (text model only)."""
    out = {}
    for name, p in model.state_dict().items():
        name = name.replace("model.language_model.", "model.")
        if name.startswith("model.visual.") or (tied and name == "lm_head.weight"):
            continue
        out[name] = p.detach()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_expected_tensors_match_save_pretrained(tiny_hf: TinyFactory, kind: str) -> None:
    d = tiny_hf(kind)
    cfg = load_config(d)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    text = {k: v for k, v in on_disk.items() if not k.startswith("model.visual.")}
    assert expected_tensors(cfg) == text


# kimi_linear's transformers names differ from its checkpoint's (tests/models/test_kimi_vs_hf.py)
@pytest.mark.parametrize("kind", [k for k in KINDS if not k.startswith("kimi")])
def test_loaded_tensors_equal_transformers(tiny_hf: TinyFactory, kind: str) -> None:
    d = tiny_hf(kind)
    cfg = load_config(d)
    ours = load_checkpoint(d, cfg, torch.float32, progress=False)
    ref = _hf_runtime_params(hf_reference(d), cfg.tie_word_embeddings)
    if cfg.linear_fused_qkvz:
        # the fused projections are checked through HF's own reordering below
        ref = {
            k: v for k, v in ref.items() if ".in_proj_qkvz." not in k and ".in_proj_ba." not in k
        }
        converted = {k for k in ours if any(f".{p}.weight" in k for p in
                                            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))}
        assert len(converted) == 4 * len(cfg.linear_attention_layers)
        ours = {k: v for k, v in ours.items() if k not in converted}
    assert sorted(ours) == sorted(ref)
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert torch.equal(t, ref[name]), name


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_next_old_spelling"])
def test_qwen3_next_projections_reproduce_transformers(tiny_hf: TinyFactory, kind: str) -> None:
    d = tiny_hf(kind)
    cfg = load_config(d)
    ours = load_checkpoint(d, cfg, torch.float32, progress=False)
    hf = hf_reference(d)
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))  # [B, T, H]
    for i in cfg.linear_attention_layers:
        la = hf.model.layers[i].linear_attn
        with torch.no_grad():
            q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
        p = f"model.layers.{i}.linear_attn."
        qkv = x @ ours[p + "in_proj_qkv.weight"].T  # [B, T, 2·Hk·dk + Hv·dv]
        oq, ok, ov = qkv.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        torch.testing.assert_close(oq.view(1, 5, Hk, dk), q, rtol=0, atol=1e-6)
        torch.testing.assert_close(ok.view(1, 5, Hk, dk), k, rtol=0, atol=1e-6)
        torch.testing.assert_close(ov.view(1, 5, Hv, dv), v, rtol=0, atol=1e-6)
        oz = (x @ ours[p + "in_proj_z.weight"].T).view(1, 5, Hv, dv)
        torch.testing.assert_close(oz, z, rtol=0, atol=1e-6)
        torch.testing.assert_close(x @ ours[p + "in_proj_b.weight"].T, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(x @ ours[p + "in_proj_a.weight"].T, a, rtol=0, atol=1e-6)


def test_dtype_cast(tiny_hf: TinyFactory) -> None:
    d = tiny_hf("qwen3_5_moe", dtype=torch.bfloat16)
    cfg = load_config(d)
    raw = _read_all(d / "model.safetensors")
    ours = load_checkpoint(d, cfg, torch.float32, progress=False)
    assert all(t.dtype == torch.float32 for t in ours.values())
    I = cfg.moe_intermediate_size
    bank = ours["model.layers.2.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    assert torch.equal(bank[5, I:], raw["model.layers.2.mlp.experts.5.up_proj.weight"].float())
    half = load_checkpoint(d, cfg, torch.bfloat16, progress=False)
    assert torch.equal(half["model.norm.weight"], raw["model.norm.weight"])


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe_vl"])
def test_sharded_equals_single_file(tiny_hf: TinyFactory, kind: str) -> None:
    single, sharded = tiny_hf(kind), tiny_hf(kind, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert not (sharded / "model.safetensors").exists()
    cfg = load_config(single)
    a = load_checkpoint(single, cfg, torch.float32, progress=False)
    b = load_checkpoint(sharded, cfg, torch.float32, progress=False)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fused_experts_on_disk_accepted(tiny_hf: TinyFactory, tmp_path: Path) -> None:
    src = tiny_hf("qwen3_5_moe")
    cfg = load_config(src)
    tensors = _read_all(src / "model.safetensors")
    p = "model.layers.1.mlp.experts."
    E = cfg.num_experts
    gate_up = torch.stack([torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"),
                                      tensors.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)])
    down = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    tensors[p + "gate_up_proj"], tensors[p + "down_proj"] = gate_up, down
    shutil.copy(src / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    a = load_checkpoint(src, cfg, torch.float32, progress=False)
    b = load_checkpoint(tmp_path, cfg, torch.float32, progress=False)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # a fused bank with the wrong layout is named in the error
    tensors[p + "down_proj"] = down.transpose(1, 2).contiguous()  # [E, I, H] instead of [E, H, I]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.down_proj.*\[8, 64, 32\]"):
        load_checkpoint(tmp_path, cfg, torch.float32, progress=False)


@pytest.fixture
def no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any tensor data is read: validation must come first."""
    def refuse(self: _Reader, name: str) -> torch.Tensor:
        raise AssertionError(f"read {name} before validation finished")
    monkeypatch.setattr(_Reader, "raw", refuse)


def _corrupt(src: Path, dst: Path, shard: str, edit: str, name: str) -> None:
    shutil.copytree(src, dst)
    tensors = _read_all(dst / shard)
    if edit == "delete":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})


# (family, tensor, edit, what the error must also say): a truncated tensor names both shapes,
# a deleted one says "missing" and the shape it should have
BAD_TENSORS = [
    ("qwen3_next", "model.layers.3.self_attn.q_proj.weight", "shape", ["[128, 64]", "[127, 64]"]),
    ("qwen3_moe", "model.layers.2.mlp.experts.7.down_proj.weight", "delete",
     ["missing", "[64, 32]"]),
]


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("kind,name,edit,expect", BAD_TENSORS, ids=["shape", "missing"])
def test_bad_tensor_names_tensor_shapes_and_file(
    tiny_hf: TinyFactory, tmp_path: Path, no_reads: None, sharded: bool, kind: str, name: str,
    edit: str, expect: list[str]
) -> None:
    src = tiny_hf(kind, max_shard_size="40KB" if sharded else None)
    shard = "model.safetensors"
    if sharded:
        shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    _corrupt(src, tmp_path / "bad", shard, edit, name)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "bad", load_config(src), torch.float32, progress=False)
    msg = str(err.value)
    assert name in msg and all(e in msg for e in expect) and shard in msg


def test_unused_tensors_skipped_with_one_log_line(
    tiny_hf: TinyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    d = tiny_hf("qwen3_5_moe_vl")
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        n_visual = sum(k.startswith("model.visual.") for k in f.keys())  # noqa: SIM118
    assert n_visual > 0
    with caplog.at_level(logging.INFO, logger="ft.checkpoint"):
        out = load_checkpoint(d, load_config(d), torch.float32, progress=False)
    skips = [r.getMessage() for r in caplog.records if "skip_unused" in r.getMessage()]
    assert skips == [skips[0]] and f"tensors={n_visual}" in skips[0]
    assert not any("visual" in k or "language_model" in k for k in out)


def test_no_checkpoint_files(tmp_path: Path, tiny_hf: TinyFactory) -> None:
    cfg = load_config(tiny_hf("qwen3_moe"))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path, cfg, torch.float32, progress=False)
