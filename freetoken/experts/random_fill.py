"""Fast random fill for benchmark-sized weights (tens of GB), and `make_pool`, the random
expert banks the bandwidth measurement (experts/calibrate.py) and the CPU kernel bench read.

`torch.normal_` on a bf16 CPU tensor runs at well under 100 MB/s, so a 32 GB pool would take
minutes of device time. Benchmarks only need non-zero, non-degenerate data with the right
scale: draw one random block once and copy shifted windows of it (copies run at memory
bandwidth), so neighbouring experts differ.
"""
from __future__ import annotations

import torch
from torch import Tensor

from freetoken.experts.profile import ExpertShape
from freetoken.types.model_config import ExpertFormat
from kernels.quant import QuantBank

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


def make_pool(shape: ExpertShape, dtype: torch.dtype | ExpertFormat, pool_bytes: float,
              pin: bool = False) -> tuple[Tensor | QuantBank, Tensor | QuantBank]:
    """Random expert banks holding about `pool_bytes`: gate_up [P, 2I, H], down [P, H, I];
    QuantBanks for a quantized format (a few random experts quantized, repeated)."""
    p = max(1, int(pool_bytes // shape.expert_bytes(dtype)))
    h, i = shape.hidden, shape.inter
    if isinstance(dtype, ExpertFormat):
        from kernels.quant import quantize_bank

        g = torch.Generator().manual_seed(1)
        n = min(p, 4)
        banks = []
        for rows, cols, halves in ((2 * i, h, 2), (h, i, 1)):
            seed = quantize_bank(torch.randn(n, rows, cols, generator=g) * cols**-0.5,
                                 dtype.name, dtype.block, halves)
            idx = torch.arange(p) % n  # [P] which seed expert each pool expert copies
            bank = seed.index_select(0, idx)
            banks.append(bank.pin_memory() if pin else bank)
        return banks[0], banks[1]
    # random data, never zeros (zeros can run faster); filled first, pinned afterwards
    gate_up = random_fill_(torch.empty(p, 2 * i, h, dtype=dtype), h**-0.5, 1)  # [P, 2I, H]
    down = random_fill_(torch.empty(p, h, i, dtype=dtype), i**-0.5, 2)  # [P, H, I]
    if pin:
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    return gate_up, down
