"""Our Triton kernels on a CPU-only machine run under the interpreter.

TRITON_INTERPRET must be set before a kernel module is imported (`triton.jit` reads it when it
wraps the function), so it is set here, before any test module of this folder is collected.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
