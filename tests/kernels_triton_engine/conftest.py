"""The decode step's Triton kernels and the CUDA code path of the decode step, interpreted on
the CPU. TRITON_INTERPRET must be set before the kernel modules are imported, so it is set here,
before any test module of this folder is collected."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.models.conftest import tiny_hf  # noqa: F401  (shared session fixture)
