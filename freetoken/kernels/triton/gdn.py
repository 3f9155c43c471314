"""Gated DeltaNet decode step on the state pools in place: the short causal conv and the gated
delta rule, each one launch, indexed by state slot (no gather, no scatter).

Pools (`freetoken.cache.tensors.StateTensors`): conv_pool [S, C, Kc-1] in the model
dtype (the last Kc-1 conv inputs, oldest first); ssm_pool [S, Hv, dk, dv] fp32. `slots` [B]
(int32 or int64) names each row's slot; slots must be distinct within a launch (two rows on one
slot would race). Grids depend on shapes only and nothing is read back to the host, so both
launches can be captured in a CUDA graph.

Semantics are those of `GatedDeltaNet.forward`'s decode branch (freetoken/layers/
linear_attention.py) and `recurrent_gated_delta` (freetoken/layers/gated_delta.py), per value head
h with key head h // (Hv/Hk) and state S [dk, dv]:
    q̂ = l2norm(q)·dk^-½, k̂ = l2norm(k);  S ← exp(g)·S;  S ← S + k̂ ⊗ β(v − Sᵀk̂);  o = Sᵀq̂
Each program owns one (row, value head, dv block): the update is column-wise in dv, so the dv
blocks are independent and the state is read once and written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ssm_ptr, slots_ptr, o_ptr,
    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_gh, s_bb, s_bh,
    s_ss, s_sh, s_sk, s_ob, s_oh,
    scale, eps, alog_ptr, dtb_ptr,
    R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, RAW_GATES: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // R
    kk = tl.arange(0, BLOCK_K)  # [BK]
    k_ok = kk < DK
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
    v_ok = vv < DV

    q = tl.load(q_ptr + b * s_qb + hk * s_qh + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
    k = tl.load(k_ptr + b * s_kb + hk * s_kh + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + eps))
    v = tl.load(v_ptr + b * s_vb + h * s_vh + vv, mask=v_ok, other=0.0).to(tl.float32)  # [BV]
    if RAW_GATES:  # g_ptr, beta_ptr hold the projections a, b: the gates are made here
        g, beta = _gates(tl.load(g_ptr + b * s_gb + h * s_gh).to(tl.float32),
                         tl.load(beta_ptr + b * s_bb + h * s_bh).to(tl.float32),
                         tl.load(alog_ptr + h).to(tl.float32), tl.load(dtb_ptr + h).to(tl.float32),
                         beta_ptr.dtype.element_ty)
    else:
        g = tl.load(g_ptr + b * s_gb + h * s_gh).to(tl.float32)
        beta = tl.load(beta_ptr + b * s_bb + h * s_bh).to(tl.float32)
    decay = tl.exp(g)

    slot = tl.load(slots_ptr + b).to(tl.int64)
    sp = ssm_ptr + slot * s_ss + h * s_sh + kk[:, None] * s_sk + vv[None, :]  # [BK, BV]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(sp, mask=tile_ok, other=0.0) * decay  # [BK, BV] fp32
    kv_mem = tl.sum(s * k[:, None], 0)  # [BV]
    delta = (v - kv_mem) * beta  # [BV]
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)  # [BV]
    tl.store(sp, s, mask=tile_ok)
    tl.store(o_ptr + b * s_ob + h * s_oh + vv, o, mask=v_ok)


def gdn_recurrent_pool(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       ssm_pool: Tensor, slots: Tensor, out: Tensor | None = None,
                       block_v: int | None = None,
                       raw_gates: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One decode step for B rows. q, k [B, Hk, dk] (raw conv outputs: L2-normalised here,
    eps 1e-6, q scaled by dk^-½); v [B, Hv, dv]; g (log decay), beta [B, Hv]; ssm_pool
    [S, Hv, dk, dv] fp32, rows `slots` [B] read and overwritten in place. Views with any row
    strides are fine (the head dims must be contiguous). Returns o [B, Hv, dv] fp32.
    `raw_gates` = (A_log, dt_bias) [Hv]: g and beta are then the projections a and b, and the
    gates are computed in this launch exactly as `gdn_gates` would (one launch less)."""
    B, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or hv % hk or ssm_pool.shape[1:] != (hv, dk, dv):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"ssm_pool {tuple(ssm_pool.shape)} do not match")
    if ssm_pool.dtype != torch.float32:
        raise ValueError("ssm_pool must be float32")
    if raw_gates is not None and (raw_gates[0].shape != (hv,) or raw_gates[1].shape != (hv,)):
        raise ValueError(f"A_log and dt_bias must be [{hv}]")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or ssm_pool.stride(-1) != 1:
        raise ValueError("the head dims of q, k, v and ssm_pool must be contiguous")
    if out is None:
        out = torch.empty(B, hv, dv, dtype=torch.float32, device=q.device)  # [B, Hv, dv]
    # dv blocks of 32 (165 registers at sm_90, no spills); 16 when that leaves fewer than two
    # programs per H200 SM (B = 1: 128 programs of 32 vs 256 of 16)
    bv = block_v or min(32 if B * hv * triton.cdiv(dv, 32) >= 264 else 16,
                        triton.next_power_of_2(dv))
    _gdn_recurrent_kernel[(B, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, ssm_pool, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        ssm_pool.stride(0), ssm_pool.stride(1), ssm_pool.stride(2), out.stride(0),
        out.stride(1),
        dk ** -0.5, 1e-6, *(raw_gates if raw_gates is not None else (g, g)),
        R=hv // hk, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv,
        RAW_GATES=raw_gates is not None, num_warps=4,
    )
    return out


@triton.jit
def _conv_update_kernel(
    x_ptr, pool_ptr, w_ptr, slots_ptr, out_ptr, C,
    s_xb, s_ps, s_pc, s_pj, s_wc, s_wj, s_ob,
    KC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    c_ok = c < C
    j = tl.arange(0, BLOCK_K)  # [BK] window column, KC-1 = the new input
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = pool_ptr + slot * s_ps + c[:, None] * s_pc  # [BC, 1]
    # the window is held in the pool's dtype, as the torch path concatenates it there
    xv = tl.load(x_ptr + b * s_xb + c, mask=c_ok, other=0.0).to(pool_ptr.dtype.element_ty)
    hist = tl.load(row + j[None, :] * s_pj, mask=c_ok[:, None] & (j[None, :] < KC - 1),
                   other=0.0)  # [BC, BK]
    win = tl.where(j[None, :] == KC - 1, xv[:, None], hist).to(tl.float32)
    w = tl.load(w_ptr + c[:, None] * s_wc + j[None, :] * s_wj,
                mask=c_ok[:, None] & (j[None, :] < KC), other=0.0).to(tl.float32)  # [BC, BK]
    acc = tl.sum(win * w, 1)  # [BC]
    tl.store(out_ptr + b * s_ob + c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty),
             mask=c_ok)
    # shift left by one: column j takes column j+1, the last takes the new input
    nxt = tl.load(row + (j[None, :] + 1) * s_pj, mask=c_ok[:, None] & (j[None, :] + 1 < KC - 1),
                  other=0.0)  # [BC, BK]
    nxt = tl.where(j[None, :] == KC - 2, xv[:, None], nxt)
    tl.store(row + j[None, :] * s_pj, nxt, mask=c_ok[:, None] & (j[None, :] < KC - 1))


def causal_conv1d_update_pool(x: Tensor, conv_pool: Tensor, weight: Tensor, slots: Tensor,
                              out: Tensor | None = None) -> Tensor:
    """x [B, C] new projected inputs; conv_pool [S, C, Kc-1] updated in place at `slots` [B];
    weight [C, Kc] (conv1d.weight[:, 0, :]). Returns silu(Σ_j [conv_pool[slot] | x]_j · w_j)
    [B, C] in x's dtype, accumulated in fp32."""
    B, C = x.shape
    kc = weight.shape[1]
    if conv_pool.shape[1:] != (C, kc - 1) or weight.shape[0] != C or kc < 2:
        raise ValueError(f"shapes x {tuple(x.shape)}, conv_pool {tuple(conv_pool.shape)}, "
                         f"weight {tuple(weight.shape)} do not match")
    if x.stride(1) != 1:
        raise ValueError("x's channels must be contiguous")
    if out is None:
        out = torch.empty(B, C, dtype=x.dtype, device=x.device)  # [B, C]
    if out.shape != (B, C) or out.stride(1) != 1:
        raise ValueError("out must be [B, C] with contiguous channels")
    bc = min(256, triton.next_power_of_2(C))
    _conv_update_kernel[(B, triton.cdiv(C, bc))](
        x, conv_pool, weight, slots, out, C,
        x.stride(0), conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2),
        weight.stride(0), weight.stride(1), out.stride(0),
        KC=kc, BLOCK_C=bc, BLOCK_K=triton.next_power_of_2(kc), num_warps=4,
    )
    return out


@triton.jit
def _gates(a, b, a_log, dt_bias, BETA_DT: tl.constexpr):
    """(g, beta) fp32 from fp32 a, b, A_log, dt_bias, as GatedDeltaNet.forward: beta rounded to
    BETA_DT (b's dtype) as torch.sigmoid(b) returns it."""
    x = a + dt_bias
    # softplus as torch computes it (threshold 20); log1p(e) by Kahan's trick: exact for tiny e
    e = tl.exp(x)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    sp = tl.where(x > 20.0, x, log1p)  # past 20, e may be inf: that branch is not taken
    return -tl.exp(a_log) * sp, tl.sigmoid(b).to(BETA_DT).to(tl.float32)


@triton.jit(do_not_specialize=["N"])  # sizes/indices: 1 compile
def _gdn_gates_kernel(
    a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, N, HV, s_a, s_b,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] over B*Hv
    ok = i < N
    row = i // HV
    h = i % HV
    g, beta = _gates(tl.load(a_ptr + row * s_a + h, mask=ok, other=0.0).to(tl.float32),
                     tl.load(b_ptr + row * s_b + h, mask=ok, other=0.0).to(tl.float32),
                     tl.load(alog_ptr + h, mask=ok, other=0.0).to(tl.float32),
                     tl.load(dtb_ptr + h, mask=ok, other=0.0).to(tl.float32),
                     beta_ptr.dtype.element_ty)
    tl.store(g_ptr + i, g, mask=ok)
    tl.store(beta_ptr + i, beta.to(beta_ptr.dtype.element_ty), mask=ok)


def gdn_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """The decay and write gates in one launch: g = -exp(A_log)·softplus(a + dt_bias) [B, Hv]
    fp32 and beta = sigmoid(b) [B, Hv] in b's dtype, as GatedDeltaNet.forward computes them.
    a, b [B, Hv] (in_proj_a / in_proj_b outputs); a_log, dt_bias [Hv]."""
    B, hv = a.shape
    if b.shape != a.shape or a_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"shapes a {tuple(a.shape)}, b {tuple(b.shape)}, A_log "
                         f"{tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)} do not match")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b must be contiguous along heads")
    g = torch.empty(B, hv, dtype=torch.float32, device=a.device)  # [B, Hv]
    beta = torch.empty(B, hv, dtype=b.dtype, device=a.device)  # [B, Hv]
    n = B * hv
    if n:
        # one block size for every B (each BLOCK is a compile; a decode step's B * Hv of 32-128
        # leaves most of one program's lanes masked, which costs nothing measurable)
        block = 1024
        _gdn_gates_kernel[(triton.cdiv(n, block),)](
            a, b, a_log, dt_bias, g, beta, n, hv, a.stride(0), b.stride(0),
            BLOCK=block, num_warps=4,
        )
    return g, beta
