"""Parameters that stay float32 in a bf16 / fp16 model, as transformers'
`_keep_in_fp32_modules_strict` keeps them (DeepSeek-V3 / Kimi-Linear routers, KDA's dt_bias):
the checkpoint reader loads them in float32 (`layout.fp32_tensors`), and a model-wide
`.to(dtype)` then moves them without rounding them."""
from __future__ import annotations

import torch
from torch import nn


class KeepFp32(nn.Module):
    fp32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):
        keep = {n: getattr(self, n).data for n in self.fp32_params
                if getattr(self, n).dtype == torch.float32}
        super()._apply(fn, recurse)
        for n, data in keep.items():
            p = getattr(self, n)
            if p.dtype != torch.float32:
                p.data = data.to(p.device)
        return self
