"""The one expert oracle (freetoken/kernels/reference.py `expert_ffn_reference`, float64) on a
sample of a kernel's tokens. At the real shape (1100 banks of 2048 x 1024, up to 300 tokens of
top-8) the oracle over every entry takes minutes; on a few tokens it reads only the bank rows they
route to, so the H200 test (test_triton_moe_gpu.py) stays seconds long. Every entry is still checked
for being written (ids >= 0) or left alone (ids < 0); test_fused_moe.py runs the same check
under the interpreter, and shows it fails on a wrong sampled entry or an unwritten one."""
from __future__ import annotations

import torch
from torch import Tensor

from freetoken.kernels.reference import expert_ffn_reference

SAMPLE = 8  # tokens compared with the oracle: 64 entries at top-8


def sample_tokens(T: int, n: int = SAMPLE, seed: int = 0) -> Tensor:
    """Sorted token indices [min(T, n)] (int64, CPU): every token when T <= n, else the first,
    the last and n - 2 drawn between them."""
    if T <= n:
        return torch.arange(T)
    g = torch.Generator().manual_seed(seed)
    mid = torch.randperm(T - 2, generator=g)[:n - 2] + 1
    return torch.cat([torch.tensor([0, T - 1]), mid]).sort().values


def check_sampled(y: Tensor, x: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, *,
                  rel_tol: float, worst_tol: float, n: int = SAMPLE, seed: int = 0) -> Tensor:
    """y [T, K, H]: a kernel's output into a NaN-poisoned buffer for x [T, H], ids [T, K]
    (-1: no expert), banks gate_up [S, 2I, H], down [S, H, I] (any device). Asserts entries
    with ids < 0 are still NaN and those with ids >= 0 all finite; on the sampled tokens,
    against the oracle, the relative error of all their entries < rel_tol and of the worst
    one < worst_tol. Returns the sampled token indices."""
    keep = ids >= 0  # [T, K]
    assert torch.isnan(y[~keep]).all(), "an entry with id < 0 was written"
    assert torch.isfinite(y[keep]).all(), "an entry with id >= 0 was not written (or is inf)"
    tok = sample_tokens(ids.shape[0], n, seed)
    want = expert_ffn_reference(x[tok.to(x.device)], ids[tok.to(ids.device)], gate_up, down)
    k = keep[tok.to(keep.device)].cpu()  # [n, K]
    got, want = y[tok.to(y.device)].double().cpu()[k], want[k]  # [entries, H]
    rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    worst = ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)).max().item()
    assert rel < rel_tol and worst < worst_tol, (
        f"tokens {tok.tolist()}: rel {rel:.2e}, worst entry {worst:.2e}")
    return tok


def act_reference(x: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, act,
                  y0: Tensor) -> Tensor:
    """The oracle with an activation (`ExpertAct`: gpt-oss's "oai" or DeepSeek-V4's "clamp")
    over every entry [T, K, H] float64; entries with ids < 0 keep y0 (the kernel leaves them)."""
    want = expert_ffn_reference(x, ids, gate_up, down, act=act)
    return torch.where((ids >= 0)[..., None], want, y0.double())


def check_entries(y: Tensor, want: Tensor, ids: Tensor, tol: float = 1e-5) -> None:
    """y [T, K, H] (any device) against `act_reference`'s want: entries with ids < 0 still
    NaN, the worst written entry's relative error < tol."""
    keep = ids >= 0
    assert torch.isnan(y[~keep]).all(), "an entry with id < 0 was written"
    got, w = y[keep].double().cpu(), want[keep]
    per = (got - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-30)
    assert per.max() < tol, f"worst entry relative error {per.max():.2e}"
