"""Gated delta rule (Gated DeltaNet) in plain torch: chunked form for prefill, recurrent form
for decode. Both compute, per value head h, with state S [dk, dv] (float32):

    S_t = exp(g_t) · S_{t-1};  S_t += k_t ⊗ β_t (v_t − S_tᵀ k_t);  o_t = S_tᵀ (q_t / √dk)

Shapes: n tokens, H value heads (q/k already expanded to H heads and L2-normalised), K = dk,
V = dv, C chunk size, N chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for a batch. q, k [B, H, K]; v [B, H, V]; g, beta [B, H]; state [B, H, K, V] fp32.
    Returns o [B, H, V] fp32 and the new state."""
    q, k, v = q.float() * (q.shape[-1] ** -0.5), k.float(), v.float()
    s = state * g.float().exp()[..., None, None]  # [B, H, K, V]
    kv_mem = torch.einsum("bhkv,bhk->bhv", s, k)  # [B, H, V]
    delta = (v - kv_mem) * beta.float()[..., None]  # [B, H, V]
    s = s + k[..., :, None] * delta[..., None, :]  # [B, H, K, V]
    o = torch.einsum("bhkv,bhk->bhv", s, q)  # [B, H, V]
    return o, s


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state: torch.Tensor, chunk: int = 64
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k [n, H, K]; v [n, H, V]; g, beta [n, H]; state [H, K, V] fp32.
    Returns o [n, H, V] fp32 and the final state [H, K, V]."""
    n = q.shape[0]
    pad = (chunk - n % chunk) % chunk
    # -> [H, N, C, ·] float32
    def prep(x: torch.Tensor) -> torch.Tensor:
        x = x.float().transpose(0, 1)  # [H, n, ·]
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])

    q = prep(q * (q.shape[-1] ** -0.5))  # [H, N, C, K]
    k, v = prep(k), prep(v)  # [H, N, C, K], [H, N, C, V]
    g, beta = prep(g), prep(beta)  # [H, N, C]
    gc = g.cumsum(-1)  # [H, N, C] cumulative log-decay inside the chunk
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (
        (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()
    )  # [H,N,C,C]
    kb, vb = k * beta[..., None], v * beta[..., None]
    # Solve (I + tril(diag(β) K Kᵀ ⊙ decay, -1)) X = [β V | β K exp(gc)] (UT transform)
    a = (kb @ k.transpose(-1, -2)) * decay  # [H, N, C, C]
    a = a.masked_fill(~torch.ones_like(upper).tril(-1), 0.0) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(a, vb, upper=False, unitriangular=True)  # [H, N, C, V]
    w = torch.linalg.solve_triangular(a, kb * gc.exp()[..., None], upper=False,
                                      unitriangular=True)  # [H, N, C, K]
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C] (causal: decay is 0 above diagonal)
    q_dec = q * gc.exp()[..., None]  # [H, N, C, K]
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]  # [H, N, C, K]
    chunk_decay = gc[..., -1].exp()  # [H, N]
    # the scan over chunks as a torch loop: the one-kernel scan
    # (freetoken/kernels/triton/gdn_chunk.py,
    # exact) took 0.774 s for an 8k chunk of the 20-layer shape against the loop's 0.274 s on
    # the H200 (2026-11-30), so it is not wired in (docs/architecture.md, "Not built yet")
    s = state.float()  # [H, K, V]
    out = torch.empty_like(u)  # [H, N, C, V]
    for i in range(q.shape[1]):
        v_new = u[:, i] - w[:, i] @ s  # [H, C, V]
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    o = out.reshape(out.shape[0], -1, out.shape[-1])[:, :n].transpose(0, 1)  # [n, H, V]
    return o, s
