"""Quantized expert banks: the FP8 block-scaled and MXFP4 formats, kept quantized from the host
store through the link into the GPU slots, and their torch quantize / dequantize.

A bank is E experts' [R, C] weight matrices (gate_up: R = 2I rows [gate | up], C = H; down:
R = H, C = I). `QuantBank` holds one in its checkpoint format:

- "fp8":   `data` float8_e4m3fn [E, R, C] and `scale` float32 [E, halves * ceil(R' / B),
           ceil(C / B)], R' = R / halves: one scale per B x B block (B = 128 as Qwen3.6-FP8 and
           DeepSeek-V3 store `weight_scale_inv`), w = q * scale. A gate_up bank has halves = 2:
           gate and up keep their own block grids (the checkpoint's two tensors side by side),
           so row r of the up half reads scale row ceil(I / B) + (r - I) // B.
- "mxfp4": `data` uint8 [E, R, C / 2], two e2m1 codes a byte (low nibble the even column, as
           gpt-oss's `*_blocks` store them), `scale` uint8 e8m0 [E, R, C / 32] (`*_scales`):
           w = e2m1(code) * 2^(scale - 127), one scale per 32 columns (B = 32).

A bank quacks like the weight tensor where the runtime moves it: indexing over experts, `shape`
(the logical [E, R, C]), `to`, `pin_memory`, `copy_`, item assignment. Compute paths either
read it in their kernel (the CPU expert kernel) or call `dequantize` (`as_weight`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MX_BLOCK = 32
# e2m1 code -> value (bit 3 the sign), the OCP MX table gpt-oss's checkpoints use
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
QUANT_FORMATS = ("fp8", "mxfp4")


@dataclass
class QuantBank:
    """See the module docstring. `data` / `scale` carry a leading expert dim when the bank is
    3-d (shape [E, R, C]); indexing one expert gives the 2-d bank [R, C]."""

    data: Tensor
    scale: Tensor
    fmt: str
    block: int
    halves: int = 1
    cols: int = 0  # logical C (mxfp4 packs two columns a byte)

    def __post_init__(self) -> None:
        if self.fmt not in QUANT_FORMATS:
            raise ValueError(f"unknown expert format {self.fmt!r}; expected one of "
                             f"{QUANT_FORMATS}")
        if not self.cols:
            self.cols = self.data.shape[-1] * (2 if self.fmt == "mxfp4" else 1)

    # -- tensor-like surface --------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.cols))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def dim(self) -> int:
        return self.data.dim()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + \
            self.scale.numel() * self.scale.element_size()

    def _like(self, data: Tensor, scale: Tensor) -> QuantBank:
        return QuantBank(data, scale, self.fmt, self.block, self.halves, self.cols)

    def __getitem__(self, idx) -> QuantBank:
        return self._like(self.data[idx], self.scale[idx])

    def __setitem__(self, idx, src: QuantBank) -> None:
        self.data[idx] = src.data
        self.scale[idx] = src.scale

    def index_select(self, dim: int, index: Tensor) -> QuantBank:
        assert dim == 0, "a bank is indexed over its experts"
        return self._like(self.data.index_select(0, index), self.scale.index_select(0, index))

    def index_copy_(self, dim: int, index: Tensor, src: QuantBank) -> QuantBank:
        assert dim == 0, "a bank is indexed over its experts"
        self.data.index_copy_(0, index, src.data)
        self.scale.index_copy_(0, index, src.scale)
        return self

    def copy_(self, src: QuantBank, non_blocking: bool = False) -> QuantBank:
        self.data.copy_(src.data, non_blocking=non_blocking)
        self.scale.copy_(src.scale, non_blocking=non_blocking)
        return self

    def to(self, device, non_blocking: bool = False) -> QuantBank:
        return self._like(self.data.to(device, non_blocking=non_blocking),
                          self.scale.to(device, non_blocking=non_blocking))

    def cpu(self) -> QuantBank:
        return self.to("cpu")

    def detach(self) -> QuantBank:
        return self._like(self.data.detach(), self.scale.detach())

    def contiguous(self) -> QuantBank:
        return self._like(self.data.contiguous(), self.scale.contiguous())

    def pin_memory(self) -> QuantBank:
        return self._like(self.data.pin_memory(), self.scale.pin_memory())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense weights [.., R, C] in `dtype` (computed in float32, float64 kept)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        if self.fmt == "fp8":
            s = expand_block_scale(self.scale.to(work), self.data.shape[-2], self.cols,
                                   self.block, self.halves)
            return (self.data.to(work) * s).to(dtype)
        lut = torch.tensor(E2M1_VALUES, dtype=work, device=self.data.device)
        codes = torch.stack((self.data & 0x0F, self.data >> 4), dim=-1).flatten(-2)  # [.., C]
        s = torch.exp2(self.scale.to(work) - 127.0).repeat_interleave(MX_BLOCK, dim=-1)
        return (lut[codes.long()] * s).to(dtype)


def empty_bank(fmt: str, experts: int, rows: int, cols: int, halves: int, block: int,
               device: torch.device | str = "cpu") -> QuantBank:
    """A zeroed bank of `experts` [rows, cols] matrices in `fmt` (the GPU slots' buffers)."""
    if fmt == "fp8":
        data = torch.zeros(experts, rows, cols, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.zeros(experts, *fp8_scale_grid(rows, cols, block, halves),
                            dtype=torch.float32, device=device)
    elif fmt == "mxfp4":
        data = torch.zeros(experts, rows, cols // 2, dtype=torch.uint8, device=device)
        scale = torch.zeros(experts, rows, cols // MX_BLOCK, dtype=torch.uint8, device=device)
    else:
        raise ValueError(f"unknown expert format {fmt!r}")
    return QuantBank(data, scale, fmt, block, halves, cols)


def fp8_scale_grid(rows: int, cols: int, block: int, halves: int = 1) -> tuple[int, int]:
    """The [rows', cols'] of an fp8 bank's block-scale grid (each half its own row blocks)."""
    return halves * math.ceil(rows // halves / block), math.ceil(cols / block)


def expand_block_scale(scale: Tensor, rows: int, cols: int, block: int, halves: int) -> Tensor:
    """Per-element scales [.., rows, cols] from a block grid [.., halves * nb, cb]."""
    half = rows // halves
    nb = math.ceil(half / block)
    r = torch.arange(rows, device=scale.device)
    srow = (r // half) * nb + (r % half) // block  # [rows]
    scol = torch.arange(cols, device=scale.device) // block  # [cols]
    return scale[..., srow, :][..., scol]


def quantize_fp8(w: Tensor, block: int = 128, halves: int = 1) -> QuantBank:
    """Block-scaled FP8 of w [.., R, C] as released checkpoints make it: per B x B block (each
    half its own blocks), scale = amax / 448 and q = round(w / scale) in e4m3."""
    *lead, rows, cols = w.shape
    wf = w.detach().float()
    half = rows // halves
    nb, cb = math.ceil(half / block), math.ceil(cols / block)
    pad_r, pad_c = nb * block - half, cb * block - cols
    x = wf.reshape(*lead, halves, half, cols)
    x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))  # [.., h, nb*B, cb*B]
    x = x.reshape(*lead, halves, nb, block, cb, block)
    amax = x.abs().amax(dim=(-3, -1))  # [.., h, nb, cb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = scale.reshape(*lead, halves * nb, cb)
    s = expand_block_scale(scale, rows, cols, block, halves)
    q = (wf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantBank(q, scale.contiguous(), "fp8", block, halves, cols)


def quantize_mxfp4(w: Tensor, halves: int = 1) -> QuantBank:
    """MXFP4 of w [.., R, C] (C a multiple of 32) as the OCP MX spec and gpt-oss make it: per
    32 columns the shared exponent floor(log2(amax)) - 2 (e2m1's largest exponent), stored
    e8m0; each value rounded to the nearest e2m1 of w / 2^exponent, saturating at ±6."""
    *lead, rows, cols = w.shape
    if cols % MX_BLOCK:
        raise ValueError(f"mxfp4 needs columns in multiples of {MX_BLOCK}, got {cols}")
    g = w.detach().float().reshape(*lead, rows, cols // MX_BLOCK, MX_BLOCK)
    amax = g.abs().amax(dim=-1)  # [.., R, C/32]
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2.0,
                    torch.full_like(amax, -127.0)).clamp(-127.0, 127.0)
    v = (g / torch.exp2(e)[..., None]).clamp(-6.0, 6.0)  # [.., R, C/32, 32]
    grid = torch.tensor(E2M1_VALUES[:8], device=v.device)
    mag = (v.abs()[..., None] - grid).abs().argmin(dim=-1)  # nearest magnitude code
    codes = (mag + 8 * (v < 0).long()).to(torch.uint8).reshape(*lead, rows, cols)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantBank(packed.contiguous(), (e + 127.0).to(torch.uint8), "mxfp4", MX_BLOCK, halves,
                     cols)


def quantize_bank(w: Tensor, fmt: str, block: int = 128, halves: int = 1) -> QuantBank:
    """w [.., R, C] in `fmt` ("fp8" with B x B blocks, or "mxfp4"); `halves` 2 for a gate_up
    bank (its fp8 gate and up grids apart; for mxfp4 only recorded)."""
    if fmt == "fp8":
        return quantize_fp8(w, block, halves)
    if fmt == "mxfp4":
        return quantize_mxfp4(w, halves)
    raise ValueError(f"unknown expert format {fmt!r}; expected one of {QUANT_FORMATS}")


def as_weight(w: Tensor | QuantBank, dtype: torch.dtype) -> Tensor:
    """A dense weight for a torch path: w itself, or a quantized bank dequantized to dtype."""
    return w.dequantize(dtype) if isinstance(w, QuantBank) else w
