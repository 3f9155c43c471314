"""Build a model from a checkpoint directory: config → runtime tensors → module on device."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from freetoken.log import get_logger, kv

if TYPE_CHECKING:
    from freetoken.experts.setup import MoEOptions
from freetoken.models.qwen import QwenMoE
from freetoken.types.model_config import ModelConfig, load_config

log = get_logger("model")


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device | str,
                dtype: torch.dtype) -> QwenMoE:
    from freetoken.models.registry import model_class

    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}")
    return model.to(device=device, dtype=dtype).eval()


def load_model(model_dir: str | Path, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", progress: bool = True,
               moe: MoEOptions | None = None, kv_reserve_bytes: int = 0) -> QwenMoE:
    """Load a checkpoint. With `moe` (a non-fused backend) the routed experts go to the host
    expert store and the slot cache; only the rest of the model moves to `device`.
    The expert runtime is attached as `model.moe_runtime`."""
    from freetoken.checkpoint.reader import read_weights
    from freetoken.experts.setup import MoEOptions, configure_experts

    t0 = time.perf_counter()
    cfg = load_config(model_dir)
    dtype = dtype or (torch.float32 if str(device) == "cpu" else cfg.torch_dtype)
    # FTW or safetensors, read in place; pinned in place for a CUDA run (the expert store's
    # own pin_memory() is then a no-op)
    tensors = read_weights(model_dir, cfg, dtype, pin=torch.device(device).type == "cuda",
                           progress=progress)
    model = build_model(cfg, tensors, "cpu", dtype)
    del tensors
    model.moe_runtime = configure_experts(model, moe or MoEOptions(), device, kv_reserve_bytes)
    model = model.to(device).fuse_projections()
    if torch.device(device).type == "cpu" or model.moe_runtime.backend in ("cpu", "hybrid", "auto"):
        # the C++ CPU kernels (decode linears, attention, experts) are built on first use, about
        # 10 s once per machine: now, rather than inside the first request
        from kernels.cpu.ext import load_kernel

        load_kernel()
    n = sum(p.numel() for p in model.parameters())
    log.info(kv("loaded", model=Path(model_dir).name, family=cfg.model_type, params=n,
                dtype=str(dtype).replace("torch.", ""), device=device,
                seconds=f"{time.perf_counter() - t0:.1f}"))
    return model
