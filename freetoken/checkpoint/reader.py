"""One entry point for weights: FTW when the directory has an FTW index, else safetensors."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from freetoken.checkpoint.ftw import is_ftw, load_ftw
from freetoken.checkpoint.safetensors_reader import load_checkpoint
from freetoken.types.model_config import ModelConfig


def read_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, pin: bool = False,
                 progress: bool = True, threads: int | None = None,
                 stats: dict[str, Any] | None = None) -> dict[str, Tensor]:
    """Runtime-named host tensors (safetensors_reader's contract), pinned in place when `pin`
    (a CUDA run) and the stored dtype is `dtype`."""
    if is_ftw(model_dir):
        return load_ftw(model_dir, cfg, dtype, progress=progress, pin=pin, threads=threads,
                        stats=stats)
    return load_checkpoint(model_dir, cfg, dtype=dtype, device="cpu", progress=progress, pin=pin,
                           threads=threads, stats=stats)
