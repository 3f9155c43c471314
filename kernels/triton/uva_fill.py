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

Shapes: F fetch entries, N elements per expert row (2I·H or H·I).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


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
