"""The gated DeltaNet kernel `train_demo` trains with: fla-core's chunked gated delta rule on
CUDA (checked against transformers' torch form first), transformers' torch form elsewhere.

transformers' `Qwen3_5MoeGatedDeltaNet.forward` calls the module-level name
`torch_chunk_gated_delta_rule` of its modeling file at call time (5.17 and 5.24 alike); `use()`
points that name at the chosen implementation, so what trains is still transformers' own model
with only the chunked recurrence swapped (the short conv stays transformers' `F.conv1d`
fallback: causal_conv1d is not installed anywhere we train; a depthwise conv of kernel 4 is
cheap next to the rest).

fla's kernels are Triton-autotuned over ~12 configs each (about 20 kernels forward and
backward), and a fresh GPU machine compiles every config: minutes of a one-call budget. `use()`
keeps the first `autotune_configs` configs of each fla kernel (1 by default; 0 keeps all):
any config is correct, our heads (K = V = 32) are too small for the choice to matter much.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

KERNELS = ("auto", "fla", "torch")


def _modeling():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    return m


def block_optional_kernels(kernel: str) -> None:
    """Before transformers' modeling file is imported: never causal_conv1d (not installed where
    we train; its torch fallback is exact), and no fla at all for the torch path (so no
    transformers default picks it up)."""
    sys.modules["causal_conv1d"] = None  # type: ignore[assignment]
    if kernel == "torch":
        sys.modules["fla"] = None  # type: ignore[assignment]


def _trim_autotune(keep: int) -> int:
    """Keep the first `keep` configs of every fla Triton autotuner made from now on; returns
    how many autotuners were cut (read after fla's import)."""
    from triton.runtime import autotuner

    orig = autotuner.Autotuner.__init__
    cut = [0]

    def init(self, fn, arg_names, configs, *args, **kwargs):
        f = fn
        while hasattr(f, "fn"):  # heuristics / JITFunction wrappers
            f = f.fn
        if keep and len(configs) > keep and getattr(f, "__module__", "").startswith("fla."):
            configs = list(configs)[:keep]
            cut[0] += 1
        orig(self, fn, arg_names, configs, *args, **kwargs)

    autotuner.Autotuner.__init__ = init
    return cut  # type: ignore[return-value]


def _bare_fla() -> None:
    """`fla` as a bare namespace: its `__init__` imports fla.layers and fla.models, which import
    transformers' model classes and can break on a transformers fla was not built against; the
    ops need neither."""
    import importlib.metadata
    import importlib.util
    import types

    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core is not installed")
    pkg = types.ModuleType("fla")
    pkg.__path__ = list(spec.submodule_search_locations)
    try:
        pkg.__version__ = importlib.metadata.version("fla-core")  # type: ignore[attr-defined]
    except importlib.metadata.PackageNotFoundError:
        pkg.__version__ = "0"  # type: ignore[attr-defined]
    sys.modules["fla"] = pkg


def load_fla(autotune_configs: int, say: Callable[[str], None] = print
             ) -> tuple[Callable[..., Any], int]:
    """(fla's chunk_gated_delta_rule, autotuners cut). Raises ImportError without fla."""
    cut = _trim_autotune(autotune_configs)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - its package __init__ failed: import the ops alone
        say(f"ft.train: fla_bare_import reason={type(e).__name__}: {str(e)[:160]}")
        _bare_fla()
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule, cut[0]  # type: ignore[index]


def torch_reference() -> Callable[..., Any]:
    """transformers' own torch chunked form (unwrapped from its hub-kernel decorator)."""
    f = _modeling().torch_chunk_gated_delta_rule
    while hasattr(f, "__wrapped__"):
        f = f.__wrapped__
    return f


_ARGS = ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens")


def fla_adapter(fla_fn: Callable[..., Any], counter: list[int]) -> Callable[..., Any]:
    """transformers' call signature onto fla's (q, k, v: [B, T, H(v), D]; g, beta: [B, T, HV]);
    `counter[0]` counts calls, so a run can show the kernel it trained with was really used."""
    def chunk(query, key, value, g, beta, chunk_size: int = 64, **kwargs):
        counter[0] += 1
        kw = {k: v for k, v in kwargs.items() if k in _ARGS and v is not None}
        return fla_fn(query, key, value, g=g, beta=beta, **kw)
    return chunk


def check_against_torch(fn: Callable[..., Any], device: str, dtype: str = "float32",
                        seed: int = 0) -> dict[str, float]:
    """Relative max error of `fn` against transformers' torch form (in fp32, on the same
    inputs rounded to `dtype`), forward and every input's gradient, on [2, 200, 2|4, 32]: value
    heads grouped over key heads (`fn` gets 2 key heads; the reference gets them repeated, as
    transformers repeats them), a partial last chunk. Bug this catches: a kernel/version
    mismatch (head grouping, scale, gate units) that would train another model than the one the
    engine serves."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, dtype)

    def rnd(*shape, fn_=torch.randn):
        return fn_(*shape, generator=gen).to(device=device, dtype=dt)

    B, T, H, HV, D = 2, 200, 2, 4, 32
    base = {"query": rnd(B, T, H, D), "key": rnd(B, T, H, D), "value": rnd(B, T, HV, D),
            "g": (-rnd(B, T, HV, fn_=torch.rand) * 0.5).float(),
            "beta": rnd(B, T, HV, fn_=torch.rand)}
    weight = torch.linspace(-1, 1, B * T * HV * D, device=device).view(B, T, HV, D)
    outs = []
    for f, cast in ((fn, dt), (torch_reference(), torch.float32)):
        x = {k: v.detach().to(cast if k != "g" else torch.float32).requires_grad_()
             for k, v in base.items()}
        q, k = x["query"], x["key"]
        if f is not fn:
            q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
        o, _ = f(q, k, x["value"], g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True)
        (o.float() * weight).sum().backward()
        outs.append({"out": o.detach().float(), **{  # no gradient at all counts as zeros
            k: (v.grad if v.grad is not None else torch.zeros_like(v)).float()
            for k, v in x.items()}})
    return {k: float((outs[0][k] - outs[1][k]).abs().max() / outs[1][k].abs().max().clamp_min(
        1e-12)) for k in outs[1]}


def _use_torch(counter: list[int], reason: str, say: Callable[[str], None]
               ) -> tuple[str, list[int]]:
    """transformers' torch form, set explicitly (its modeling file may have been imported with
    fla importable, which makes fla its default)."""
    ref = torch_reference()

    def chunk(*args, **kwargs):
        counter[0] += 1
        return ref(*args, **kwargs)

    _modeling().torch_chunk_gated_delta_rule = chunk
    say(f"ft.train: dn_kernel kernel=torch reason={reason}")
    return "torch", counter


def use(kernel: str, device: str, autotune_configs: int = 1, tol: float = 0.1,
        say: Callable[[str], None] = print) -> tuple[str, list[int]]:
    """Point transformers' chunked gated delta rule at `kernel` ("auto": fla on CUDA when it
    imports and passes `check_against_torch` within `tol` of the largest value: bf16 rounding
    stays near 1e-2, a wrong head grouping, scale or gate is off by O(1)), else torch. Returns
    (the kernel used, its call counter). An explicit "fla" that fails to import or match
    raises."""
    counter = [0]
    if kernel == "torch" or (kernel == "auto" and device != "cuda"):
        return _use_torch(counter, "asked" if kernel == "torch" else device, say)
    try:
        t0 = time.time()
        fla_fn, cut = load_fla(autotune_configs, say)
        adapter = fla_adapter(fla_fn, counter)
        # bf16 q/k/v/beta and fp32 g: what the model passes it under autocast (the variant
        # Triton compiles for training; an fp32 check would compile every kernel again)
        err = check_against_torch(adapter, device, "bfloat16")
    except Exception as e:  # ImportError, or a Triton/driver error on this machine
        if kernel == "fla":
            raise
        return _use_torch(counter, f"fla_failed error={type(e).__name__}: {str(e)[:200]}", say)
    say("ft.train: dn_check " + " ".join(f"{k}={v:.1e}" for k, v in err.items())
        + f" autotuners_cut={cut} seconds={time.time() - t0:.1f}")
    bad = [k for k, v in err.items() if v > tol]
    if bad:
        if kernel == "fla":
            raise RuntimeError(f"fla's chunk_gated_delta_rule differs from torch's: {err}")
        return _use_torch(counter, f"mismatch worst={bad}", say)
    _modeling().torch_chunk_gated_delta_rule = adapter
    counter[0] = 0
    say("ft.train: dn_kernel kernel=fla")
    return "fla", counter
