"""The device-driven fill (freetoken/kernels/triton/uva_fill.py `fill_banks`) over quantized banks:
codes and scales of FP8 / MXFP4 experts copied into their slots in one launch, against a plain copy
(the host-driven `SlotCache.fill`). Interpreted on the CPU; test_uva_fill_quant_gpu.py (next to this
file) runs it from a pinned store and inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.store import ExpertStore
from freetoken.kernels.quant import QuantBank, empty_bank, quantize_bank
from freetoken.kernels.triton.uva_fill import fill_banks
from freetoken.types.model_config import ExpertFormat

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _banks(fmt: str, E: int, H: int, I: int, seed: int) -> tuple[QuantBank, QuantBank]:
    g = torch.Generator().manual_seed(seed)
    block = 32
    gu = quantize_bank(torch.randn(E, 2 * I, H, generator=g), fmt, block, 2)  # [E, 2I, H]
    dn = quantize_bank(torch.randn(E, H, I, generator=g), fmt, block, 1)  # [E, H, I]
    return gu, dn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # compare stored bytes (fp8 NaN-free either way)


def _poisoned(like: QuantBank, n: int) -> QuantBank:
    b = empty_bank(like.fmt, n, like.shape[1], like.shape[2], like.halves, like.block, DEV)
    b.data.view(torch.uint8).fill_(0x5A)
    b.scale.view(torch.uint8).fill_(0xA5)
    return b


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_fill_banks_copies_codes_and_scales(fmt: str) -> None:
    """Each valid entry's four parts (gate_up codes and scales, down codes and scales, four row
    sizes and two dtypes) land in its slot, several chunks per part; padding entries and other
    slots keep their bytes. Bugs caught: a part's chunks offset by another part's count, a
    part's rows read with another's size, the scales left behind."""
    src_gu, src_dn = _banks(fmt, E=6, H=64, I=96, seed=1)
    dst_gu, dst_dn = _poisoned(src_gu, 5), _poisoned(src_dn, 5)
    experts = torch.tensor([4, -1, 0, 5], device=DEV)
    slots = torch.tensor([1, -1, 3, -1], device=DEV)  # the last: no slot, not copied
    fill_banks(src_gu, dst_gu, src_dn, dst_dn, experts, slots, block=64, iters=2)
    for src, dst in ((src_gu, dst_gu), (src_dn, dst_dn)):
        for part in ("data", "scale"):
            s, d = getattr(src, part), getattr(dst, part).cpu()
            assert torch.equal(_bits(d[1]), _bits(s[4])) and torch.equal(_bits(d[3]), _bits(s[0]))
            for k in (0, 2, 4):
                assert (_bits(d[k]) == (0x5A if part == "data" else 0xA5)).all()
        assert torch.equal(dst.cpu()[1].dequantize(), src[4].dequantize())


def test_fill_banks_byte_rows() -> None:
    """A part whose row is not whole 32-bit words (here MXFP4 scales of 3 x 1 bytes) makes the
    launch copy bytes for every part: same result."""
    g = torch.Generator().manual_seed(3)
    src = [QuantBank(torch.randint(0, 256, (4, r, 16), generator=g, dtype=torch.uint8),
                     torch.randint(0, 256, (4, r, 1), generator=g, dtype=torch.uint8),
                     "mxfp4", 32, h) for r, h in ((6, 2), (3, 1))]
    dst = [_poisoned(b, 3) for b in src]
    fill_banks(src[0], dst[0], src[1], dst[1], torch.tensor([2, 3], device=DEV),
               torch.tensor([0, 2], device=DEV), block=16, iters=1)
    for s, d in zip(src, dst):
        for part in ("data", "scale"):
            got = getattr(d, part).cpu()
            assert torch.equal(got[0], getattr(s, part)[2])
            assert torch.equal(got[2], getattr(s, part)[3])
            assert (got[1] == (0x5A if part == "data" else 0xA5)).all()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_slot_cache_fill_device_matches_the_host_fill(fmt: str) -> None:
    """`SlotCache.fill_device` over a quantized store (the kernel) leaves every slot bank
    exactly as the host-driven `fill` (per-row copies) does, over decisions that fetch, hit and
    evict."""
    L, E, H, I, S = 2, 6, 64, 64, 5
    banks = [_banks(fmt, E, H, I, seed=10 + m) for m in range(L)]
    store = ExpertStore([b[0] for b in banks], [b[1] for b in banks], pin=DEV == "cuda")
    fmt_ = ExpertFormat(fmt, 32)
    host, dev = (SlotCache(L, E, H, I, S, torch.float32, DEV, fmt=fmt_) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        m = step % L
        ids = torch.randint(0, E, (2, 2), generator=g).to(DEV)
        dh, dd = host.decide(m, ids), dev.decide(m, ids)
        assert torch.equal(dh.fetch_slots, dd.fetch_slots)
        host.fill(m, dh.fetch_experts, dh.fetch_slots, store)
        dev.fill_device(m, dd.fetch_experts, dd.fetch_slots, store)
        for a, b in ((host.gate_up_slots, dev.gate_up_slots),
                     (host.down_slots, dev.down_slots)):
            assert torch.equal(_bits(a.data), _bits(b.data))
            assert torch.equal(_bits(a.scale), _bits(b.scale))
