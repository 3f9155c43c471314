"""Fast random fill for benchmark-sized weights (tens of GB).

`torch.normal_` on a bf16 CPU tensor runs at well under 100 MB/s, so a 32 GB pool would take
minutes of device time. Benchmarks only need non-zero, non-degenerate data with the right
scale: draw one random block once and copy shifted windows of it (copies run at memory
bandwidth), so neighbouring experts differ.
"""
from __future__ import annotations

import torch

_BLOCK = 1 << 24  # 16 M elements


def random_fill_(t: torch.Tensor, std: float, seed: int = 0) -> torch.Tensor:
    """Fill `t` (any float dtype, any device) with N(0, std)-distributed windows; returns t."""
    g = torch.Generator().manual_seed(seed)
    block = (torch.randn(_BLOCK + 4096, generator=g) * std).to(t.dtype).to(t.device)
    flat = t.view(-1)
    n, step, i = flat.numel(), _BLOCK, 0
    while i < n:
        k = min(step, n - i)
        off = (i // step * 977) % 4096  # shift the window so repeated blocks are not aligned
        flat[i:i + k].copy_(block[off:off + k])
        i += k
    return t
