"""The one switch between our Triton kernels and the callers' torch paths.

`triton_for(x, name)` is `freetoken.kernels.triton.<name>` when x lives on CUDA and triton imports,
else None (the caller takes its torch path). Callers look it up through this module
(`dispatch.triton_for(...)`), so tests point it at the interpreter to run the CUDA path on
the CPU. Logs through the stdlib logger `ft.kernels` (kernels import nothing of freetoken but
its envs).
"""
from __future__ import annotations

import functools
import importlib
import logging

from torch import Tensor

log = logging.getLogger("ft.kernels")


@functools.cache
def triton_module(name: str):
    """freetoken.kernels.triton.<name>, or None when triton or the module is missing (logged
    once)."""
    try:
        return importlib.import_module(f"freetoken.kernels.triton.{name}")
    except (ImportError, RuntimeError) as e:  # no triton, or triton finding no driver
        log.info("triton_unavailable module=%s error=%s", name, type(e).__name__)
        return None


def triton_for(x: Tensor, name: str):
    """The Triton module `name` when x lives on CUDA and triton is there, else None."""
    return triton_module(name) if x.is_cuda else None
