"""Engine flag parsing: sizes, dtypes, the default MoE backend and the KV pool default."""
from __future__ import annotations

import argparse

import pytest
import torch

from freetoken.cli_options import (
    _size,
    add_cache_args,
    add_moe_args,
    default_backend,
    moe_options,
    resolve_dtype,
)
from freetoken.models.presets import preset_config


def test_sizes_and_dtypes() -> None:
    assert _size("12GiB") == 12 * 2**30 and _size("1.5G") == 1_500_000_000
    assert _size("512MiB") == 512 * 2**20 and _size("4096") == 4096
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("auto") is None
    with pytest.raises(SystemExit):
        resolve_dtype("int4")


def test_moe_flags_and_default_backend() -> None:
    p = argparse.ArgumentParser()
    add_moe_args(p)
    add_cache_args(p)
    a = p.parse_args(["--moe-cache-rate", "0.37", "--moe-cpu-layers", "2"])
    assert a.moe_backend is None  # resolved at load time
    o = moe_options(a, default_backend(preset_config("qwen3.6-35b-a3b"), torch.bfloat16, "cpu",
                                       a.kv_reserve_tokens))
    assert (o.backend, o.cache_rate, o.cpu_layers, o.kv_reserve_tokens) == ("fused", 0.37, 2, 8192)
    assert moe_options(p.parse_args(["--moe-backend", "hybrid"])).backend == "hybrid"
    with pytest.raises(ValueError):
        moe_options(p.parse_args(["--moe-cache-rate", "1.5"]))
