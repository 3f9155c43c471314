"""Expert fills driven by the device: copy the experts a slot decision chose to fetch from the
pinned host pool into their GPU slots, reading host memory straight through its device-mapped
address (UVA zero-copy) — no value of the decision travels to the host, so the fill can sit in a
captured decode step.

A fill is `dst[slots[i]] = src[experts[i]]` for the valid entries of the decision's padded lists
(`experts [F]`, `slots [F]`, -1 past q), one row = one expert's bank (gate_up [2I, H] or down
[H, I]). Programs of padding entries return at once, so the launch grid depends only on F and
the row size.

Pinned host memory allocated by CUDA (torch's `pin_memory()`) is mapped into the device's
address space under unified addressing, with the same pointer; the SMs' loads then travel over
PCIe, so throughput depends on how many 16-byte loads are in flight: BLOCK elements per program
and many programs per row keep the link busy. Measured inside the offload decode step on the
H200: 53 GB/s of fills per token, the link's pinned-copy rate (docs/benchmarks.md, session 3);
not yet compared with the copy engine in isolation.

Quantized banks (`freetoken.kernels.quant.QuantBank`: codes + scales, each with its own row size and
dtype) take the same path through `fill_banks`: an expert's four parts (gate_up codes, gate_up
scales, down codes, down scales) viewed as 32-bit words (bytes where a part's row is not a
whole number of words) and copied by one launch of `_fill_quad_kernel`.

Shapes: F fetch entries, N elements per expert row (2I·H or H·I).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freetoken.kernels.quant import QuantBank


@triton.jit
def _fill_pair_kernel(src_a, dst_a, src_b, dst_b, experts_ptr, slots_ptr, NA, NB, CA,
                      BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """dst[slots[i]] = src[experts[i]] for entry i = program 0 (padding entries, -1, return
    at once), over two banks in one launch: chunks c < CA copy rows of bank a (NA elements
    each), the others rows of bank b (NB elements)."""
    i = tl.program_id(0)  # fetch entry
    c = tl.program_id(1)  # chunk: bank a's first, then bank b's
    e = tl.load(experts_ptr + i).to(tl.int64)
    s = tl.load(slots_ptr + i).to(tl.int64)
    if (e >= 0) & (s >= 0):
        if c < CA:
            src = src_a + e * NA
            dst = dst_a + s * NA
            n = NA
            base = c.to(tl.int64) * (BLOCK * ITERS)
        else:
            src = src_b + e * NB
            dst = dst_b + s * NB
            n = NB
            base = (c - CA).to(tl.int64) * (BLOCK * ITERS)
        for j in tl.static_range(ITERS):
            offs = base + j * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def fill_pair(src_a: Tensor, dst_a: Tensor, src_b: Tensor, dst_b: Tensor, experts: Tensor,
              slots: Tensor, block: int = 2048, iters: int = 4) -> None:
    """`fill_rows` for two banks of the same experts and slots (an expert's gate_up and down
    rows) in one launch: one kernel node per layer in a captured step instead of two."""
    for src, dst in ((src_a, dst_a), (src_b, dst_b)):
        assert src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype
        assert src.is_contiguous() and dst.is_contiguous()
    assert src_a.dtype == src_b.dtype
    F = experts.numel()
    if F == 0:
        return
    na, nb = src_a[0].numel(), src_b[0].numel()
    ca, cb = triton.cdiv(na, block * iters), triton.cdiv(nb, block * iters)
    _fill_pair_kernel[(F, ca + cb)](src_a, dst_a, src_b, dst_b, experts, slots, na, nb, ca,
                                    BLOCK=block, ITERS=iters, num_warps=4)


def fill_rows(src: Tensor, dst: Tensor, experts: Tensor, slots: Tensor,
              block: int = 2048, iters: int = 4) -> None:
    """dst[slots[i]] = src[experts[i]] for entries with both >= 0.
    src [E, ...] (pinned host, or any tensor the device can address); dst [S, ...] on the device
    with the same row shape and dtype; experts, slots [F] int64 on the device. (The pair
    kernel with every chunk in its first bank.)"""
    assert src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype
    assert src.is_contiguous() and dst.is_contiguous()
    n = src[0].numel()
    F = experts.numel()
    if F == 0:
        return
    chunks = triton.cdiv(n, block * iters)
    _fill_pair_kernel[(F, chunks)](src, dst, src, dst, experts, slots, n, n, chunks,
                                   BLOCK=block, ITERS=iters, num_warps=4)


@triton.jit
def _fill_quad_kernel(s0, d0, s1, d1, s2, d2, s3, d3, experts_ptr, slots_ptr, N0, N1, N2, N3,
                      C1, C2, C3, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """dst_p[slots[i]] = src_p[experts[i]] for entry i = program 0 over four parts p (one
    element type), chunks [0, C1) part 0, [C1, C2) part 1, [C2, C3) part 2, the rest part 3
    (Np elements per row); padding entries (-1) return at once."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(experts_ptr + i).to(tl.int64)
    s = tl.load(slots_ptr + i).to(tl.int64)
    if (e >= 0) & (s >= 0):
        if c < C1:
            src = s0 + e * N0
            dst = d0 + s * N0
            n = N0
            k = c
        elif c < C2:
            src = s1 + e * N1
            dst = d1 + s * N1
            n = N1
            k = c - C1
        elif c < C3:
            src = s2 + e * N2
            dst = d2 + s * N2
            n = N2
            k = c - C2
        else:
            src = s3 + e * N3
            dst = d3 + s * N3
            n = N3
            k = c - C3
        base = k.to(tl.int64) * (BLOCK * ITERS)
        for j in tl.static_range(ITERS):
            offs = base + j * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def _rows(t: Tensor, word: torch.dtype) -> Tensor:
    """A contiguous [E, ...] part as [E, n] elements of `word` (a view: same memory)."""
    assert t.is_contiguous()
    return t.view(t.shape[0], -1).view(torch.uint8).view(word)


def fill_banks(src_gu: QuantBank, dst_gu: QuantBank, src_dn: QuantBank, dst_dn: QuantBank,
               experts: Tensor, slots: Tensor, block: int = 2048, iters: int = 4) -> None:
    """`fill_pair` for quantized banks: both banks' codes and scales of the fetched experts
    (dst_*[slots[i]] = src_*[experts[i]] for entries with both >= 0) in one launch. src: the
    pinned host store's banks (or any the device can address); dst: the slot banks, of the
    same format, row shapes and dtypes."""
    parts = [(src_gu.data, dst_gu.data), (src_gu.scale, dst_gu.scale),
             (src_dn.data, dst_dn.data), (src_dn.scale, dst_dn.scale)]
    for src, dst in parts:
        assert src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype
    F = experts.numel()
    if F == 0:
        return
    # 32-bit words where every part's row is whole words (fewer, wider loads), else bytes
    row_bytes = [src[0].numel() * src.element_size() for src, _ in parts]
    word = torch.int32 if all(b % 4 == 0 for b in row_bytes) else torch.uint8
    views = [(_rows(src, word), _rows(dst, word)) for src, dst in parts]
    ns = [v[0].shape[1] for v in views]
    blk = block if word == torch.int32 else 4 * block  # the same bytes per program either way
    chunks = [triton.cdiv(n, blk * iters) for n in ns]
    c1 = chunks[0]
    c2, c3 = c1 + chunks[1], c1 + chunks[1] + chunks[2]
    (s0, d0), (s1, d1), (s2, d2), (s3, d3) = views
    _fill_quad_kernel[(F, c3 + chunks[3])](s0, d0, s1, d1, s2, d2, s3, d3, experts, slots,
                                           *ns, c1, c2, c3, BLOCK=blk, ITERS=iters,
                                           num_warps=4)
