"""Build a model from a checkpoint directory: config → runtime tensors → module on device."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from freetoken.experts.runtime import MoERuntime
from freetoken.log import get_logger, kv
from freetoken.models.qwen import QwenMoE
from freetoken.types.config import MoEConfig
from freetoken.types.model_config import ModelConfig, load_config
from kernels.quant import QuantBank

log = get_logger("model")


_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
          "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def meta_without_init() -> Iterator[None]:
    """Modules built on the meta device without their parameter initialisers: every parameter
    is assigned from the checkpoint right after, and `nn.Embedding`'s `normal_` on a meta tensor
    runs through torch's Python refs, whose first call imports torch._dynamo (~2-4 s of every
    start, measured on the demo's `ft serve`) for an initialisation nobody reads."""
    saved = {n: getattr(torch.nn.init, n) for n in _INITS}
    try:
        for n in _INITS:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device | str,
                dtype: torch.dtype) -> QwenMoE:
    from freetoken.models.registry import model_class

    with meta_without_init():
        model = model_class(cfg)(cfg)
    # quantized expert banks (an FP8 checkpoint's) are no parameters: their blocks hold them
    quant = {n: t for n, t in tensors.items() if isinstance(t, QuantBank)}
    dense = {n: t for n, t in tensors.items() if n not in quant}
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    missing = [n for n in missing if n not in quant]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}")
    for name, bank in quant.items():
        if name.endswith(".gate_up_proj"):
            owner = name[:-len(".gate_up_proj")]
            model.get_submodule(owner).hold_banks(bank, quant[owner + ".down_proj"])
    return model.to(device=device, dtype=dtype).eval()


def load_model(model_dir: str | Path, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", progress: bool = True) -> QwenMoE:
    """Load a checkpoint with every expert resident on `device` (the `fused` layout)."""
    return load_with_experts(model_dir, None, dtype, device, progress)[0]


def load_with_experts(model_dir: str | Path, moe: MoEConfig | None,
                      dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                      progress: bool = True, kv_reserve_bytes: int = 0,
                      read: Callable[..., dict[str, torch.Tensor]] | None = None
                      ) -> tuple[QwenMoE, MoERuntime | None]:
    """Load a checkpoint and build its expert runtime from `moe` (None: none, every expert
    resident). With a non-fused backend the routed experts go to the host expert store and
    the slot cache; only the rest of the model moves to `device`. `read(model_dir, cfg,
    dtype, pin=, progress=)`: where the runtime-named host tensors come from (default: the
    in-memory random weights for a `ft bench checkpoint --format random` directory, else
    `checkpoint.reader.read_weights` of its files), so every command that loads a directory
    (serve, generate, bench elastic) takes both kinds."""
    from freetoken.checkpoint.reader import read_weights
    from freetoken.models.random_weights import is_random_checkpoint, random_runtime_weights

    if read is None:
        read = random_runtime_weights if is_random_checkpoint(model_dir) else read_weights

    t0 = time.perf_counter()
    cfg = load_config(model_dir)
    dtype = dtype or (torch.float32 if str(device) == "cpu" else cfg.torch_dtype)
    # FTW or safetensors, read in place; pinned in place for a CUDA run (the expert store's
    # own pin_memory() is then a no-op)
    tensors = read(model_dir, cfg, dtype, pin=torch.device(device).type == "cuda",
                   progress=progress)
    model = build_model(cfg, tensors, "cpu", dtype)
    del tensors
    distinct = model.dedup_output_head()
    if distinct is not None:
        log.info(kv("output_head_dedup", rows=cfg.vocab_size, distinct=distinct))
    rt = MoERuntime.build(model, moe, device, kv_reserve_bytes) if moe is not None else None
    model = model.to(device).fuse_projections()
    if torch.device(device).type == "cpu" or (rt is not None
                                              and rt.backend in ("cpu", "hybrid", "auto")):
        # the C++ CPU kernels (decode linears, attention, experts) are built on first use, about
        # 10 s once per machine: now, rather than inside the first request
        from kernels.cpu.ext import load_kernel

        load_kernel()
    n = sum(p.numel() for p in model.parameters())
    log.info(kv("loaded", model=Path(model_dir).name, family=cfg.model_type, params=n,
                dtype=str(dtype).replace("torch.", ""), device=device,
                seconds=f"{time.perf_counter() - t0:.1f}"))
    return model, rt
