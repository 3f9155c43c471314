"""Kimi Delta Attention's recurrence in plain torch: chunked form for prefill, recurrent form for
decode. The gated delta rule with a per-channel decay: per head, state S [K, V] float32,

    S_t = diag(exp(g_t)) · S_{t-1};  S_t += k_t ⊗ β_t (v_t − S_tᵀ k_t);  o_t = S_tᵀ (q_t / √K)

with g_t [K] (gated DeltaNet's g_t is one scalar per head). q, k arrive L2-normalised.

Shapes: n tokens, B rows, H heads, K key dim, V value dim, C chunk size.
"""
from __future__ import annotations

import torch


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for a batch. q, k [B, H, K]; v [B, H, V]; g [B, H, K] (log decay); beta [B, H];
    state [B, H, K, V] fp32 -> o [B, H, V] fp32 and the new state."""
    q, k, v = q.float() * (q.shape[-1] ** -0.5), k.float(), v.float()
    s = state * g.float().exp()[..., None]  # [B, H, K, V]
    kv_mem = torch.einsum("bhkv,bhk->bhv", s, k)  # [B, H, V]
    delta = (v - kv_mem) * beta.float()[..., None]  # [B, H, V]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor, chunk: int = 64
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k [n, H, K]; v [n, H, V]; g [n, H, K]; beta [n, H]; state [H, K, V] fp32
    -> o [n, H, V] fp32 and the final state. Chunk by chunk: within a chunk the decays between
    two positions are per channel, exp(G_i − G_j) [C, C, K] with G the running sum of g (never
    above 1 for j <= i, so no overflow), and the UT transform is a unit-triangular solve."""
    n, H, K = q.shape
    s = state.float()
    out = torch.empty(n, H, v.shape[-1], dtype=torch.float32, device=q.device)  # [n, H, V]
    scale = K ** -0.5
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        c = hi - lo
        qc = q[lo:hi].float().transpose(0, 1) * scale  # [H, C, K]
        kc = k[lo:hi].float().transpose(0, 1)  # [H, C, K]
        vc = v[lo:hi].float().transpose(0, 1)  # [H, C, V]
        bc = beta[lo:hi].float().transpose(0, 1)[..., None]  # [H, C, 1]
        G = g[lo:hi].float().transpose(0, 1).cumsum(1)  # [H, C, K]
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # j <= i
        decay = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(
            ~causal[None, :, :, None], float("-inf")).exp()  # [H, C, C, K]
        kk = torch.einsum("hik,hjk,hijk->hij", kc * bc, kc, decay)  # [H, C, C] β_i k_i·k_j
        a = kk.masked_fill(~causal.tril(-1), 0.0) + torch.eye(c, device=q.device)
        u = torch.linalg.solve_triangular(a, vc * bc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(a, kc * bc * G.exp(), upper=False,
                                          unitriangular=True)  # [H, C, K]
        intra = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay)  # [H, C, C], 0 above diagonal
        v_new = u - w @ s  # [H, C, V]
        out[lo:hi] = ((qc * G.exp()) @ s + intra @ v_new).transpose(0, 1)
        last = G[:, -1:, :]  # [H, 1, K]
        s = s * last.transpose(1, 2).exp() + (kc * (last - G).exp()).transpose(1, 2) @ v_new
    return out, s
