"""Fixtures for model tests: tiny transformers checkpoints built once per session."""
from __future__ import annotations

import sys

# transformers picks fla / causal_conv1d kernels when importable; they need a GPU.
sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.models.fixtures import build_tiny_hf

TinyFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> TinyFactory:
    """`tiny_hf(kind, dtype=torch.float32, max_shard_size=None) -> Path`, cached per session.

    Callers must not modify the returned directory (copy it first)."""
    cache: dict[tuple[str, torch.dtype, str | int | None], Path] = {}

    def make(kind: str, dtype: torch.dtype = torch.float32,
             max_shard_size: str | int | None = None) -> Path:
        key = (kind, dtype, max_shard_size)
        if key not in cache:
            tag = f"{kind}-{str(dtype).replace('torch.', '')}-{max_shard_size or 'single'}"
            cache[key] = build_tiny_hf(kind, tmp_path_factory.mktemp(tag), dtype=dtype,
                                       max_shard_size=max_shard_size)
        return cache[key]

    return make
