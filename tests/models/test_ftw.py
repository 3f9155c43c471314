"""FTW: conversion round trip, same greedy tokens as safetensors, clear errors on damage, and
the parallel direct-I/O reader's fallback."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from freetoken.checkpoint import direct_io
from freetoken.checkpoint.ftw import INDEX, FtwError, is_ftw, load_ftw, read_index, verify_ftw
from freetoken.checkpoint.ftw_write import convert
from freetoken.checkpoint.host_buffer import ALIGN
from freetoken.checkpoint.layout import expected_runtime
from freetoken.checkpoint.safetensors_reader import load_checkpoint
from freetoken.checkpoint.st_inplace import InPlace
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.model_config import load_config
from tests.models.conftest import TinyFactory
from tests.models.fixtures import KINDS


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("kind,dtype,shard", [
    ("qwen3_5_moe", torch.bfloat16, None),
    ("qwen3_moe", torch.float32, "200KB"),
    ("qwen3_next", torch.bfloat16, None),  # fused qkvz/ba: converted at conversion, not load
    ("qwen3_moe_dense_layers", torch.float32, None),
])
def test_round_trip_bit_identical(tiny_hf: TinyFactory, tmp_path: Path, kind: str,
                                  dtype: torch.dtype, shard: str | None) -> None:
    src = tiny_hf(kind, dtype=dtype, max_shard_size=shard)
    cfg = load_config(src)
    convert(src, tmp_path / "ftw", shard_bytes=256 << 10, progress=False)
    assert is_ftw(tmp_path / "ftw")
    want = load_checkpoint(src, cfg, dtype=dtype, progress=False)
    got = load_ftw(tmp_path / "ftw", cfg, dtype, progress=False)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert _bytes(got[name]) == _bytes(t), name
    # independent of our reader: the banks hold the file's own per-expert bytes
    layer = cfg.moe_layers[0]
    p = f"{cfg.weight_prefix}layers.{layer}.mlp.experts."
    gate_up = got[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    I = cfg.moe_intermediate_size
    files = sorted(src.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for e in (0, cfg.num_experts - 1):
                if f"{p}{e}.up_proj.weight" in h.keys():  # noqa: SIM118
                    assert torch.equal(gate_up[e, I:], h.get_tensor(f"{p}{e}.up_proj.weight"))
    index, entries = read_index(tmp_path / "ftw")
    assert all(e.offset % ALIGN == 0 for e in entries.values())
    for s in index["shards"]:  # bounded shards: over the bound only when one tensor is larger
        names = [e for e in entries.values() if e.shard.name == s["file"]]
        assert s["bytes"] <= 256 << 10 or len(names) == 1
    assert (tmp_path / "ftw" / "config.json").read_text() == (src / "config.json").read_text()
    assert verify_ftw(tmp_path / "ftw", progress=False) == len(entries)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_ftw_generates_the_safetensors_tokens(tiny_hf: TinyFactory, tmp_path: Path,
                                              kind: str) -> None:
    src = tiny_hf(kind, dtype=torch.bfloat16)
    convert(src, tmp_path / "ftw", progress=False)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, d in (("safetensors", src), ("ftw", tmp_path / "ftw")):
        # fp32 compute over bf16 files (the CPU default) and bf16 compute read in place
        for dt in (torch.float32, torch.bfloat16):
            model = load_model(d, dtype=dt, progress=False)
            runs[name, dt] = generate(model, prompt, sp, []).token_ids
    for dt in (torch.float32, torch.bfloat16):
        assert len(runs["ftw", dt]) == 12
        assert runs["ftw", dt] == runs["safetensors", dt]


@pytest.fixture
def ftw_dir(tiny_hf: TinyFactory, tmp_path: Path) -> Path:
    convert(tiny_hf("qwen3_5_moe", dtype=torch.bfloat16), tmp_path / "ftw",
            shard_bytes=256 << 10, progress=False)
    return tmp_path / "ftw"


def _load(d: Path) -> None:
    load_ftw(d, load_config(d), torch.bfloat16, progress=False)


def test_truncated_shard_is_a_clear_error(ftw_dir: Path) -> None:
    shard = max(ftw_dir.glob("*.ftw"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - ALIGN)
    with pytest.raises(FtwError, match=rf"{shard.name}.*truncated"):
        _load(ftw_dir)


def test_corrupted_bytes_are_found_by_verify(ftw_dir: Path) -> None:
    _, entries = read_index(ftw_dir)
    e = entries["model.layers.1.mlp.experts.down_proj"]
    with open(e.shard, "r+b") as f:
        f.seek(e.offset + 10)
        b = f.read(1)
        f.seek(e.offset + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(FtwError, match="model.layers.1.mlp.experts.down_proj is corrupted"):
        verify_ftw(ftw_dir, progress=False)


def test_broken_index_and_foreign_shard_are_clear_errors(ftw_dir: Path) -> None:
    index = ftw_dir / INDEX
    good = index.read_text()
    index.write_text(good[: len(good) // 2])
    with pytest.raises(FtwError, match="unreadable FTW index"):
        _load(ftw_dir)
    index.write_text(good)
    shard = min(ftw_dir.glob("*.ftw"))
    with open(shard, "r+b") as f:
        f.write(b"NOTFTW!!")
    with pytest.raises(FtwError, match="not FTW shard 1"):
        _load(ftw_dir)


def test_index_of_another_model_is_a_clear_error(ftw_dir: Path) -> None:
    cfg = json.loads((ftw_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = cfg["num_hidden_layers"] + 1
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"] + ["linear_attention"]
    (ftw_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FtwError, match="does not match config.json"):
        _load(ftw_dir)


def test_convert_refuses_a_non_empty_destination(tiny_hf: TinyFactory, tmp_path: Path) -> None:
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "x").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        convert(tiny_hf("qwen3_moe"), tmp_path / "dst", progress=False)


def test_direct_io_falls_back_to_buffered_reads(ftw_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A filesystem without O_DIRECT (tmpfs) must still load, with one log line saying so."""
    want = load_ftw(ftw_dir, load_config(ftw_dir), torch.bfloat16, progress=False, direct=False)
    real_open = os.open

    def no_direct(path, flags, *a):  # type: ignore[no-untyped-def]
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    with caplog.at_level(logging.INFO, logger="ft.checkpoint"):
        got = load_ftw(ftw_dir, load_config(ftw_dir), torch.bfloat16, progress=False)
    assert "direct_io_unavailable" in caplog.text
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_safetensors_experts_are_read_in_place(tiny_hf: TinyFactory) -> None:
    """Per-expert HF tensors in the runtime dtype go straight into the banks (no conversion
    pass), and give the same banks as the converting path (a bf16 read of fp32 files)."""
    src = tiny_hf("qwen3_moe", dtype=torch.float32)
    cfg = load_config(src)
    from freetoken.checkpoint.safetensors_reader import checkpoint_files, scan_headers, validate

    found = scan_headers(checkpoint_files(src))
    expected = validate(cfg, found, src)
    plan = InPlace(cfg, {n: found[n].file for n in expected}, dict(expected), torch.float32)
    assert plan.consumed == set(expected)
    fast = load_checkpoint(src, cfg, torch.float32, progress=False)
    slow = load_checkpoint(src, cfg, torch.bfloat16, progress=False)
    for n, t in slow.items():
        assert torch.equal(fast[n].to(torch.bfloat16), t), n


def test_convert_copies_tokenizer_and_skips_weights(tiny_hf: TinyFactory, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_hf("qwen3_moe"), src)
    (src / "tokenizer_config.json").write_text("{}")
    convert(src, tmp_path / "ftw", progress=False)
    names = {f.name for f in (tmp_path / "ftw").iterdir()}
    assert "tokenizer_config.json" in names and "config.json" in names
    assert not any(n.endswith(".safetensors") for n in names)


@pytest.mark.parametrize("kind", KINDS)
def test_expected_runtime_is_the_models_parameter_set(tiny_hf: TinyFactory, kind: str) -> None:
    """FTW validation and `ft bench checkpoint --format ftw` use `expected_runtime`; a name or
    shape it got wrong would reject good FTW files or write ones the model cannot take."""
    from freetoken.models.registry import model_class

    cfg = load_config(tiny_hf(kind))
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    assert expected_runtime(cfg) == {n: tuple(t.shape) for n, t in model.state_dict().items()}
