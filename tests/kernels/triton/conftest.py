"""Our Triton kernels (moe/, attn/) and the CUDA code path of the decode step (engine/), on tiny
fp32 shapes. Without CUDA they run under the Triton interpreter: TRITON_INTERPRET must be set
before the kernel modules are decorated (at import), so it is set here, before any test module
of these folders is collected. Each test module skips itself when triton is not installed."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.models.conftest import tiny_hf  # noqa: F401  (shared session fixture)
