"""The sequential part of the chunked gated delta rule (prefill) in one Triton kernel.

`freetoken.layers.gated_delta.chunk_gated_delta` prepares every chunk in parallel with batched
torch ops (the UT transform's u and w, the decayed q and k, the intra-chunk scores, each
chunk's decay); what is left is a scan over the chunks that carries the state:

    for i in chunks:                                   # per value head h
        v_new  = u[i] - w[i] @ S                       # [C, V]
        out[i] = q_dec[i] @ S + intra[i] @ v_new       # [C, V]
        S      = S * decay[i] + k_dec[i]^T @ v_new     # [K, V]

In torch that is ~7 launches per chunk (an 8k-token chunk: 128 chunks x 15 layers = 13k
launches, host-bound). Here one program per (head, block of BV value columns) keeps its slice
of S in registers and walks the chunks; the value columns are independent in every line above,
so the programs never talk. fp32 throughout, `ieee` dots (the torch path is fp32 matmul), so
results match the torch loop to fp32 rounding.

Shapes: H value heads, N chunks, C chunk length, K key dim, V value dim, BV value block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from freetoken.kernels.logs import get_logger, kv

log = get_logger("kernels")
_TOO_BIG: set[tuple[int, int, int]] = set()  # tiles this GPU refused


@triton.jit(do_not_specialize=["N"])  # sizes/indices: 1 compile
def _scan_kernel(u_ptr, w_ptr, qd_ptr, kd_ptr, a_ptr, dec_ptr, s_ptr, out_ptr, N,
                 C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                 PREC: tl.constexpr):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    rc = tl.arange(0, C)
    rk = tl.arange(0, K)
    rv = vb * BV + tl.arange(0, BV)
    s_ptrs = s_ptr + h.to(tl.int64) * K * V + rk[:, None] * V + rv[None, :]
    s = tl.load(s_ptrs)  # [K, BV]
    for i in range(N):
        base = h.to(tl.int64) * N + i
        ck = base * C * K + rc[:, None] * K + rk[None, :]  # [C, K] offsets
        cv = base * C * V + rc[:, None] * V + rv[None, :]  # [C, BV] offsets
        w = tl.load(w_ptr + ck)
        u = tl.load(u_ptr + cv)
        v_new = u - tl.dot(w, s, input_precision=PREC)  # [C, BV]
        qd = tl.load(qd_ptr + ck)
        a = tl.load(a_ptr + base * C * C + rc[:, None] * C + rc[None, :])  # [C, C]
        o = tl.dot(qd, s, input_precision=PREC) + tl.dot(a, v_new, input_precision=PREC)
        tl.store(out_ptr + cv, o)
        kd = tl.load(kd_ptr + ck)
        d = tl.load(dec_ptr + base)
        s = s * d + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
    tl.store(s_ptrs, s)


def supported(C: int, K: int, V: int) -> bool:
    """Power-of-two tiles of at least 16 (tl.dot's minimum)."""
    def ok(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0
    return ok(C) and ok(K) and ok(V)


def chunk_scan(u: Tensor, w: Tensor, q_dec: Tensor, k_dec: Tensor, intra: Tensor,
               decay: Tensor, state: Tensor) -> tuple[Tensor, Tensor] | None:
    """u [H, N, C, V]; w, q_dec, k_dec [H, N, C, K]; intra [H, N, C, C]; decay [H, N];
    state [H, K, V] (all fp32) -> out [H, N, C, V], final state [H, K, V]; None when the
    kernel does not fit this GPU at these tiles (logged once)."""
    H, N, C, V = u.shape
    K = w.shape[-1]
    assert supported(C, K, V), (C, K, V)
    s = state.float().contiguous().clone()
    u = u.contiguous()  # the kernel's offsets assume row-major [H, N, C, ·] for all of them
    out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    if (C, K, V) in _TOO_BIG:
        return None
    bv = min(V, 32)
    # one stage: the loop carries S, and pipelining its loads would hold three copies of the
    # [C, K] fp32 tiles in shared memory (256 KB at C=64, K=128: over the H200's 227 KB)
    try:
        _scan_kernel[(H, V // bv)](u, w.contiguous(), q_dec.contiguous(), k_dec.contiguous(),
                                   intra.contiguous(), decay.contiguous(), s, out, N, C=C, K=K,
                                   V=V, BV=bv, PREC="ieee", num_warps=4, num_stages=1)
    except OutOfResources as e:  # a smaller GPU: the caller keeps its torch loop
        _TOO_BIG.add((C, K, V))
        log.warning(kv("gdn_chunk_scan_unavailable", chunk=C, k=K, v=V, error=str(e)[:120]))
        return None
    return out, s
