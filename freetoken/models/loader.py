"""Build a model from a checkpoint directory: config → runtime tensors → module on the host
(`read_model`) → module on its device (`place_model`); `load_model` does both. This builds the
module only: the expert runtime is composed with it above the models (cli/build.py
`load_with_experts`, between the two steps), so nothing here imports the runtime."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from freetoken.kernels.quant import QuantBank
from freetoken.log import get_logger, kv
from freetoken.models.qwen import QwenMoE
from freetoken.types.model_config import ModelConfig, load_config

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


def read_model(model_dir: str | Path, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", progress: bool = True,
               read: Callable[..., dict[str, torch.Tensor]] | None = None) -> QwenMoE:
    """The checkpoint at `model_dir` as a module on the host, not yet placed: every weight in
    `dtype` (default: float32 for a CPU `device`, else the checkpoint's), read in place and,
    for a CUDA `device`, pinned in place (the expert store's own pin_memory() is then a
    no-op); the output head's repeated rows shared. `place_model` moves it to `device`; in
    between, a caller may take the routed experts' banks out of its blocks (MoERuntime.build).
    `read(model_dir, cfg, dtype, pin=, progress=)`: where the runtime-named host tensors come
    from (default: the in-memory random weights for a `ft bench checkpoint --format random`
    directory, else `checkpoint.reader.read_weights` of its files), so every command that
    loads a directory (serve, generate, bench elastic) takes both kinds."""
    from freetoken.checkpoint.reader import read_weights
    from freetoken.models.random_weights import is_random_checkpoint, random_runtime_weights

    if read is None:
        read = random_runtime_weights if is_random_checkpoint(model_dir) else read_weights
    cfg = load_config(model_dir)
    dtype = dtype or (torch.float32 if str(device) == "cpu" else cfg.torch_dtype)
    tensors = read(model_dir, cfg, dtype, pin=torch.device(device).type == "cuda",
                   progress=progress)
    model = build_model(cfg, tensors, "cpu", dtype)
    del tensors
    distinct = model.dedup_output_head()
    if distinct is not None:
        log.info(kv("output_head_dedup", rows=cfg.vocab_size, distinct=distinct))
    return model


def place_model(model: QwenMoE, device: torch.device | str, *, cpu_kernels: bool = False,
                name: str = "", started: float | None = None) -> QwenMoE:
    """`model` (from `read_model`) moved to `device` (what is still in it: banks a runtime
    took stay where it put them) with its projections fused. The C++ CPU kernels (decode
    linears, attention, experts) are built now, about 10 s once per machine, rather than
    inside the first request, when `device` is the CPU or `cpu_kernels` (an expert backend
    that computes on the CPU). Logs `loaded` (`seconds` since `started`: `ft bench serve`
    reads it as the load phase)."""
    model = model.to(device).fuse_projections()
    if torch.device(device).type == "cpu" or cpu_kernels:
        from freetoken.kernels.cpu.ext import load_kernel

        load_kernel()
    n = sum(p.numel() for p in model.parameters())
    seconds = time.perf_counter() - started if started is not None else 0.0
    dtype = model.model.embed_tokens.weight.dtype  # (build_model casts every weight to it)
    log.info(kv("loaded", model=name, family=model.cfg.model_type, params=n,
                dtype=str(dtype).replace("torch.", ""), device=device,
                seconds=f"{seconds:.1f}"))
    return model


def load_model(model_dir: str | Path, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", progress: bool = True,
               read: Callable[..., dict[str, torch.Tensor]] | None = None) -> QwenMoE:
    """Load a checkpoint with every expert resident on `device` (the `fused` layout)."""
    t0 = time.perf_counter()
    model = read_model(model_dir, dtype, device, progress, read)
    return place_model(model, device, name=Path(model_dir).name, started=t0)
