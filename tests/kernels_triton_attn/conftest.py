"""Triton kernels of the decode step (attention, gated DeltaNet, norms) on tiny fp32 shapes.

Without CUDA they run under the Triton interpreter: TRITON_INTERPRET must be set before the
kernel modules are decorated (at import), so it is set here, before any test module imports them.
Each test module skips itself when triton is not installed (`pytest.importorskip`).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
