"""Decode-attention kernels built off the request path (issue #24 item 2, #20 item 6).

flashinfer JIT-compiles its decode module on first use: nvcc through ninja, 84-276 s into a
first start on the H200 (2026-12-02), which a request used to wait out. Now the decode runner
asks `plan_attention` which plan to start on:

- `flashinfer` wanted (`auto` where it fits, or asked for) and its module built already (the
  kernel compile cache of a restart, or flashinfer's AOT cache): flashinfer, its module loaded
  now, before `ready` (`load`), so no request pays for the load either;
- `auto`, module not built: the Triton paged kernel now, and a `PlanBuild` that builds the
  module on its own thread (the ninja subprocess runs outside the GIL, at nice +10 so the
  engine's own Triton compiles and the CPU bridge keep the cores); the runner switches to
  flashinfer at its next safe point once the build is done (`plan_switch.PlanSwitch`);
- `flashinfer` asked for, module not built: built now, blocking (a benchmark of the kernel
  wants it from the first step), Triton if that fails;
- `triton`: Triton, nothing built.

Which module: `BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa2")`, as
`attention_plans.FlashInferDecode` builds it, plans through flashinfer's *prefill* module of
the pool's dtype and head dim (`get_batch_prefill_module("fa2", ...)`, flashinfer 0.6.14
decode.py), whose `JitSpec.is_compiled` says whether its shared library exists (JIT cache dir
or AOT dir); `JitSpec.build` writes build.ninja and runs ninja under flashinfer's file lock.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.engine.attention_plans import choose_backend
from freetoken.log import get_logger, kv

log = get_logger("engine")
BUILD_NICE = 10  # the builder thread's (and so ninja's and nvcc's) niceness increment


def flashinfer_module_args(dtype: torch.dtype, head_dim: int) -> tuple:
    """`get_batch_prefill_module`'s arguments for the runner's fa2 tensor-core decode: backend,
    q/kv/o dtypes, the indptr dtype, head dims qk/vo, no positional encoding in the kernel, no
    sliding window, no logits soft cap, no fp16 QK reduction (what `plan` passes)."""
    return ("fa2", dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False)


def flashinfer_built(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decode module's shared library exists (no compiling needed to load it)."""
    from flashinfer.jit import gen_batch_prefill_module

    return bool(gen_batch_prefill_module(*flashinfer_module_args(dtype, head_dim)).is_compiled)


def flashinfer_build(dtype: torch.dtype, head_dim: int) -> None:
    """Compile the decode module (nvcc via ninja; a no-op when it is up to date)."""
    from flashinfer.jit import gen_batch_prefill_module

    spec = gen_batch_prefill_module(*flashinfer_module_args(dtype, head_dim))
    if not spec.is_aot:
        spec.build(verbose=False)


def flashinfer_load(dtype: torch.dtype, head_dim: int) -> None:
    """Load the built module into flashinfer's own cache (`functools.cache` on the same
    arguments `plan` passes), so the first `plan` finds it loaded."""
    from flashinfer.prefill import get_batch_prefill_module

    get_batch_prefill_module(*flashinfer_module_args(dtype, head_dim))


class PlanBuild:
    """The kernels of decode-attention plan `kind`, built on a thread of their own.

    `build()` runs on the builder thread (it may take minutes and must release the GIL for
    most of that: a subprocess); `load()` runs on the engine thread, at the switch. `state` is
    "building", then "ready" or "failed" (`error` says why); `wait` blocks for the end."""

    def __init__(self, kind: str, build: Callable[[], None], load: Callable[[], None],
                 what: str = "", nice: int = BUILD_NICE):
        self.kind, self.load, self.what, self.nice = kind, load, what, nice
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._build = build
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ft-build-{kind}", daemon=True)
        self._thread.start()

    @property
    def state(self) -> str:
        if not self._done.is_set():
            return "building"
        return "failed" if self.error is not None else "ready"

    def wait(self, timeout: float | None = None) -> str:
        self._done.wait(timeout)
        return self.state

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.nice:
                try:  # per thread on Linux; the ninja and nvcc processes it starts inherit it
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
                except (AttributeError, OSError):
                    pass
            self._build()
        except BaseException as e:  # noqa: BLE001  (reported at the switch: Triton stays)
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()


@dataclass(frozen=True)
class Probe:
    """How `plan_attention` asks about flashinfer's decode module (the real functions above;
    a test gives others: this machine has no flashinfer)."""

    built: Callable[[torch.dtype, int], bool] = flashinfer_built
    build: Callable[[torch.dtype, int], None] = flashinfer_build
    load: Callable[[torch.dtype, int], None] = flashinfer_load


def plan_attention(requested: str, dtype: torch.dtype, head_dim: int,
                   probe: Probe = Probe(), chosen: str | None = None
                   ) -> tuple[str, PlanBuild | None]:
    """The decode runner's first attention plan for `--decode-attention requested` and, when
    flashinfer is wanted but not built yet, the build that will replace it (module docstring).
    `chosen`: what `attention_plans.choose_backend` picked (computed here when None)."""
    kind = chosen or choose_backend(requested, dtype, head_dim)
    if kind != "flashinfer":
        return kind, None
    t0 = time.perf_counter()
    try:
        built = probe.built(dtype, head_dim)
    except Exception as e:  # noqa: BLE001  (cannot tell: build it, off the request path)
        log.warning(kv("flashinfer_probe_failed", error=repr(e)[:200]))
        built = False
    if not built and requested == "flashinfer":  # asked for by name: built now, blocking
        try:
            probe.build(dtype, head_dim)
            built = True
        except Exception as e:  # noqa: BLE001
            log.warning(kv("attention_build_failed", kind="flashinfer", blocking=True,
                           error=repr(e)[:300], using="triton"))
            return "triton", None
    if built:
        try:
            probe.load(dtype, head_dim)
        except Exception as e:  # noqa: BLE001
            log.warning(kv("attention_load_failed", kind="flashinfer", error=repr(e)[:300],
                           using="triton"))
            return "triton", None
        log.info(kv("attention_plan", kind="flashinfer", built=True,
                    load_s=f"{time.perf_counter() - t0:.2f}"))
        return "flashinfer", None
    interim = choose_backend("triton", dtype, head_dim)  # ("torch" without Triton)
    build = PlanBuild("flashinfer", lambda: probe.build(dtype, head_dim),
                      lambda: probe.load(dtype, head_dim),
                      what=f"fa2 decode dtype={dtype} head_dim={head_dim}")
    log.info(kv("attention_plan", kind=interim, building="flashinfer", what=build.what,
                nice=build.nice, switch="at the first safe point after the build"))
    return interim, build
