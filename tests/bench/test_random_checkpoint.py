"""`ft bench checkpoint --format random`: a directory without weight files whose tensors
`ft serve` makes in memory at load (a shape whose checkpoint does not fit the disk: issue 20
item 8, Qwen3.6 at 40 layers). Its weights must be exactly those `--format ftw` writes for the
same shape and seed, and the served model the same model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.bench.checkpoint_writer import write_checkpoint
from freetoken.checkpoint.reader import read_weights
from freetoken.cli.build import load_with_experts
from freetoken.models.loader import load_model
from freetoken.models.random_weights import (
    RANDOM_MARKER,
    is_random_checkpoint,
    random_runtime_weights,
)
from freetoken.types.model_config import load_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    ftw, rnd = tmp_path_factory.mktemp("ftw"), tmp_path_factory.mktemp("random")
    write_checkpoint("tiny-qwen3.5-moe", 2, ftw, "ftw", seed=3, progress=False)
    write_checkpoint("tiny-qwen3.5-moe", 2, rnd, "random", seed=3, progress=False)
    return ftw, rnd


def test_random_dir_has_no_weights_and_is_recognised(dirs) -> None:
    ftw, rnd = dirs
    assert (rnd / RANDOM_MARKER).is_file() and (rnd / "config.json").is_file()
    assert (rnd / "tokenizer.json").is_file()
    assert not [p for p in rnd.iterdir() if p.suffix in (".safetensors", ".ftw", ".bin")]
    assert is_random_checkpoint(rnd) and not is_random_checkpoint(ftw)


def test_random_weights_equal_what_ftw_writes(dirs) -> None:
    ftw, rnd = dirs
    cfg = load_config(ftw)
    want = read_weights(ftw, cfg, cfg.torch_dtype, progress=False)
    got = random_runtime_weights(rnd, cfg, cfg.torch_dtype, progress=False)
    assert set(got) == set(want)
    for n, t in want.items():
        assert got[n].shape == t.shape and got[n].dtype == t.dtype, n
        assert torch.equal(got[n], t), n


def test_the_model_served_from_it_is_the_ftw_model(dirs) -> None:
    """The loader picks the reader by the directory: `ft bench elastic --model` and
    `ft generate` on a random-format directory (they pass no reader) load the FTW model too
    (`ft bench elastic` on one raised CheckpointError "no model.safetensors")."""
    ftw, rnd = dirs
    want = load_model(ftw, dtype=torch.float32, progress=False)
    model, _ = load_with_experts(rnd, None, torch.float32, progress=False)
    w, g = want.state_dict(), model.state_dict()
    assert set(w) == set(g)
    assert all(torch.equal(w[n], g[n]) for n in w)  # fp32: a cast of the same bf16 values


def test_random_refuses_quantized_shapes(tmp_path) -> None:
    with pytest.raises(ValueError, match="dense banks only"):
        write_checkpoint("tiny-qwen3.5-moe-fp8", 1, tmp_path, "random", progress=False)
