"""freetoken/kernels/triton/fused_moe.py against the float64 expert oracle, under
TRITON_INTERPRET=1 on
the CPU.

The oracle is `freetoken.kernels.reference.expert_ffn_reference` (plain torch, not the kernel's
code): for every (t, k) with ids >= 0, y = down[id] @ (silu(gate[id] @ x[t]) * (up[id] @ x[t])) in
float64; other entries keep y's previous value, so y is poisoned first with NaN and must keep
NaN exactly there.
Shapes are tiny fp32 (the interpreter costs ~10 ms per program instance).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from freetoken.kernels.reference import expert_ffn_reference
from freetoken.kernels.triton.fused_moe import (
    fused_moe,
    fused_moe_decode,
    moe_sum,
    shared_expert_decode,
)
from freetoken.kernels.triton.moe_grouped import fused_moe_grouped, moe_align, moe_align_small, tile
from tests.kernels.triton.moe.oracle import SAMPLE, check_sampled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, S = 64, 32, 8
# small tiles so the loops over H and I take several iterations and the row blocks several programs
DECODE_SMALL = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 16}, "down": {"BLOCK_N": 32, "BLOCK_K": 16}}
GROUPED_SMALL = (tile(16, 16, 32, 2, 4, 2),
                 tile(16, 32, 16, 1, 4, 2))


def reference(x, ids, gate_up, down, y0):
    """The one expert oracle (freetoken/kernels/reference.py, float64) on the entries with ids >= 0;
    y0's values elsewhere (the kernels must leave them untouched)."""
    want = expert_ffn_reference(x.cpu(), ids.cpu(), gate_up.cpu(), down.cpu())  # [T, K, H]
    return torch.where((ids.cpu() >= 0)[..., None], want, y0.double().cpu())


def make(T, K, seed, h=H, inter=I, s=S, neg=0.25, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g)
    gate_up = torch.randn(s, 2 * inter, h, generator=g) / h**0.5
    down = torch.randn(s, h, inter, generator=g) / inter**0.5
    ids = torch.randint(0, s, (T, K), generator=g)
    ids[torch.rand(T, K, generator=g) < neg] = -1
    return x.to(dtype), ids, gate_up.to(dtype), down.to(dtype)


def check(y, ref, ids, tol):
    keep = ids >= 0
    assert torch.isnan(y[~keep]).all(), "an entry with id < 0 was written"
    assert not torch.isnan(y[keep]).any(), "an entry with id >= 0 was not written"
    got, want = y[keep].double().cpu(), ref[keep]
    rel = (got - want).norm() / want.norm().clamp_min(1e-30)
    assert rel < tol, f"relative error {rel:.2e}"
    # per entry too: one wrong row can hide in a global norm
    per = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    assert per.max() < 10 * tol, f"worst entry relative error {per.max():.2e}"


def run(fn, x, ids, gate_up, down, **kw):
    T, K = ids.shape
    y = torch.full((T, K, x.shape[1]), float("nan"), dtype=x.dtype, device=DEVICE)
    dev = [t.to(DEVICE) for t in (x, ids, gate_up, down)]
    return fn(*dev, y, **kw)


@pytest.mark.parametrize("T,K,seed", [(1, 2, 0), (2, 4, 1), (5, 3, 2)])
def test_decode_matches_float64(T, K, seed):
    x, ids, gu, dn = make(T, K, seed)
    ids[0, 0] = -1  # always at least one left-out entry
    if T > 1:
        ids[1, :] = ids[0, 1]  # a repeated expert across tokens
    y = run(fused_moe_decode, x, ids, gu, dn, config=DECODE_SMALL)
    check(y, reference(x, ids, gu, dn, torch.full((T, K, H), float("nan"))), ids, 1e-4)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_grouped_matches_float64(ids_dtype):
    """T=33, K=4: 132 entries, every bank row hit several times, some twice by one token."""
    T, K = 33, 4
    x, ids, gu, dn = make(T, K, 7)
    ids[3] = torch.tensor([5, 5, -1, 2])
    ids = ids.to(ids_dtype)
    y = run(fused_moe_grouped, x, ids, gu, dn, config=GROUPED_SMALL)
    check(y, reference(x, ids, gu, dn, torch.full((T, K, H), float("nan"))), ids, 1e-4)


def test_odd_shapes_mask_the_tails():
    """H, I not multiples of the tiles (48, 24): the masked loads of both paths."""
    h, inter = 48, 24
    x, ids, gu, dn = make(3, 2, 11, h=h, inter=inter)
    ref = reference(x, ids, gu, dn, torch.full((3, 2, h), float("nan")))
    check(run(fused_moe_decode, x, ids, gu, dn, config=DECODE_SMALL), ref, ids, 1e-4)
    check(run(fused_moe_grouped, x, ids, gu, dn, config=GROUPED_SMALL), ref, ids, 1e-4)


def test_decode_reads_bf16_banks():
    """bf16 banks on the GEMV path (loads and .to are exact in the interpreter): fp32 math."""
    x, ids, gu, dn = make(2, 2, 3, dtype=torch.bfloat16)
    ref = reference(x, ids, gu, dn, torch.full((2, 2, H), float("nan")))
    check(run(fused_moe_decode, x, ids, gu, dn, config=DECODE_SMALL), ref, ids, 1e-2)


def test_dispatch_and_strided_output():
    """fused_moe picks a path by T*K and writes into a non-contiguous y view."""
    x, ids, gu, dn = make(2, 2, 5, neg=0.0)
    ref = reference(x, ids, gu, dn, torch.zeros(2, 2, H))
    for decode in (None, False):
        big = torch.full((2, H, 2), float("nan"), device=DEVICE)
        y = big.transpose(1, 2)  # [T, K, H], stride along H is 2
        fused_moe(x.to(DEVICE), ids.to(DEVICE), gu.to(DEVICE), dn.to(DEVICE), y, decode=decode)
        check(y, ref, ids, 1e-4)


def test_the_sampled_oracle_check_of_the_gpu_test():
    """oracle.check_sampled, what test_triton_moe_gpu.py holds the kernel to at 1100 banks,
    here on the interpreted kernel: 40 tokens of top-3, 8 of them against the oracle. It
    passes on the kernel's output and fails on one wrong entry of a sampled token, on an
    unwritten entry of a token it does not sample, and on a write where ids < 0."""
    T, K = 40, 3
    x, ids, gu, dn = make(T, K, 21)
    y = run(fused_moe_grouped, x, ids, gu, dn, config=GROUPED_SMALL).cpu()
    tok = check_sampled(y, x, ids, gu, dn, rel_tol=1e-4, worst_tol=1e-3)
    assert len(tok) == SAMPLE and tok[0] == 0 and tok[-1] == T - 1
    t = next(t for t in tok.tolist() if (ids[t] >= 0).any())
    bad = y.clone()
    bad[t, int((ids[t] >= 0).nonzero()[0])] *= 1.05
    with pytest.raises(AssertionError, match="worst entry"):
        check_sampled(bad, x, ids, gu, dn, rel_tol=1e-4, worst_tol=1e-3)
    u = next(u for u in range(T) if u not in tok.tolist() and (ids[u] >= 0).any())
    bad = y.clone()
    bad[u, int((ids[u] >= 0).nonzero()[0])] = float("nan")
    with pytest.raises(AssertionError, match="not written"):
        check_sampled(bad, x, ids, gu, dn, rel_tol=1e-4, worst_tol=1e-3)
    bad = y.clone()
    bad[ids < 0] = 0.0
    with pytest.raises(AssertionError, match="id < 0 was written"):
        check_sampled(bad, x, ids, gu, dn, rel_tol=1e-4, worst_tol=1e-3)


def test_all_entries_left_out_writes_nothing():
    x, ids, gu, dn = make(2, 2, 6)
    ids[:] = -1
    for fn in (fused_moe_decode, fused_moe_grouped):
        assert torch.isnan(run(fn, x, ids, gu, dn)).all()


def test_align_pads_each_row_to_the_block():
    """moe_align: each row's entries contiguous, stable, padded to BM; blocks name their row."""
    ids = torch.tensor([[3, 1], [1, -1], [3, 3], [0, 1]])  # entries 0..7
    sorted_e, block_row, total = moe_align(ids, num_rows=5, block_m=4)
    N = 8
    assert int(total) == 12  # rows 0, 1, 3 -> 3 blocks of 4
    assert sorted_e[:12].tolist() == [6, N, N, N, 1, 2, 7, N, 0, 4, 5, N]
    assert (sorted_e[12:] == N).all()
    assert block_row.tolist()[:3] == [0, 1, 3] and (block_row[3:] == -1).all()


@pytest.mark.parametrize("T,K,S_,bm,seed", [(1, 2, 8, 16, 0), (5, 4, 8, 16, 1),
                                             (16, 8, 300, 32, 2), (13, 3, 4095, 16, 3)])
def test_align_small_kernel_equals_torch_align(T, K, S_, bm, seed):
    """The one-program alignment gives moe_align's three outputs exactly. (fused_moe_grouped
    uses it for N <= 128: the odd-shape and dispatch tests; T=33 (N=132) takes moe_align.)"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(S_, 6), (T, K), generator=g)  # few rows: long runs
    ids[torch.rand(T, K, generator=g) < 0.2] = -1
    ids[0, -1] = S_ - 1
    want = moe_align(ids, S_, bm)
    got = moe_align_small(ids.to(DEVICE), S_, bm)
    for name, a, b in zip(("sorted_entries", "block_row", "total"), want, got):
        assert a.tolist() == b.cpu().tolist(), name


def test_bad_arguments_raise():
    x, ids, gu, dn = make(2, 2, 0)
    y = torch.zeros(2, 2, H)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_moe(x, ids, gu, dn[:, :, :-1], y)
    with pytest.raises(ValueError, match="contiguous last"):
        fused_moe(x, ids, gu.transpose(1, 2).contiguous().transpose(1, 2), dn, y)
    with pytest.raises(ValueError, match="ids must be"):
        fused_moe(x, ids.float(), gu, dn, y)


def test_moe_sum_matches_float64():
    """out[t] = sum_k w[t, k] y[t, k]; H=48 with BLOCK_H=32 leaves a masked tail block."""
    g = torch.Generator().manual_seed(4)
    y, w = torch.randn(3, 4, 48, generator=g), torch.rand(3, 4, generator=g)
    want = (y.double() * w.double()[..., None]).sum(1)
    out = moe_sum(y.to(DEVICE), w.to(DEVICE), block_h=32).cpu()
    assert out.dtype == torch.float32
    assert ((out.double() - want).norm() / want.norm()) < 1e-6


def shared_reference(x, s_gate_up, s_down):
    """The shared expert on every token: the one oracle over a bank of one expert, every token
    routed to it. float64 [T, H]."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.long)  # [T, 1]
    return expert_ffn_reference(x, ids, s_gate_up[None], s_down[None])[:, 0]


def shared_weights(seed, h=H, inter=I, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    sgu = torch.randn(2 * inter, h, generator=g) / h**0.5
    sdn = torch.randn(h, inter, generator=g) / inter**0.5
    return sgu.to(dtype), sdn.to(dtype)


@pytest.mark.parametrize("T,K,h,inter,seed", [(1, 2, H, I, 0), (3, 4, H, I, 1), (2, 3, 48, 24, 2)])
def test_decode_with_shared_expert_matches_float64(T, K, h, inter, seed):
    """Bug it catches: the T shared entries appended after the N routed ones reading the routed
    bank, the wrong token, or writing into y; routed entries must stay exactly as without."""
    x, ids, gu, dn = make(T, K, seed, h=h, inter=inter)
    ids[0, 0] = -1
    sgu, sdn = shared_weights(seed, h, inter)
    ys = torch.full((T, h), float("nan"), device=DEVICE)
    y = torch.full((T, K, h), float("nan"), device=DEVICE)
    fused_moe_decode(x.to(DEVICE), ids.to(DEVICE), gu.to(DEVICE), dn.to(DEVICE), y,
                     config=DECODE_SMALL, shared=(sgu.to(DEVICE), sdn.to(DEVICE), ys))
    check(y, reference(x, ids, gu, dn, torch.full((T, K, h), float("nan"))), ids, 1e-4)
    want = shared_reference(x, sgu, sdn)
    assert ((ys.double().cpu() - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-5
    alone = run(fused_moe_decode, x, ids, gu, dn, config=DECODE_SMALL).cpu()
    assert torch.equal(alone[ids >= 0], y.cpu()[ids >= 0])


def test_shared_expert_decode_alone_matches_float64():
    x, _, _, _ = make(3, 1, 4)
    sgu, sdn = shared_weights(4)
    out = shared_expert_decode(x.to(DEVICE), sgu.to(DEVICE), sdn.to(DEVICE),
                               config=DECODE_SMALL).cpu()
    want = shared_reference(x, sgu, sdn)
    assert ((out.double() - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-5


def test_zero_missing_writes_zeros_for_left_out_entries():
    """Bug it catches: with zero_missing the caller stops clearing y (torch.empty); an entry
    with id < 0 left unwritten would feed garbage (NaN) into the weighted sum."""
    x, ids, gu, dn = make(3, 2, 8)
    ids[1, :] = -1
    ids[0, 0] = -1
    for kw in ({"decode": True}, {"decode": False}):
        y = torch.full((3, 2, H), float("nan"), device=DEVICE)
        fused_moe(x.to(DEVICE), ids.to(DEVICE), gu.to(DEVICE), dn.to(DEVICE), y,
                  zero_missing=True, **kw)
        y = y.cpu()
        assert (y[ids < 0] == 0).all(), kw
        ref = reference(x, ids, gu, dn, torch.zeros(3, 2, H))
        assert ((y.double() - ref).norm() / ref.norm()) < 1e-5, kw


def test_shared_expert_bad_shapes_raise():
    x, ids, gu, dn = make(2, 2, 0)
    sgu, sdn = shared_weights(0, inter=I // 2)  # a shared I that differs from the routed one
    with pytest.raises(ValueError, match="shared expert"):
        fused_moe_decode(x, ids, gu, dn, torch.zeros(2, 2, H), shared=(sgu, sdn, torch.zeros(2, H)))


def test_decode_tiles_come_from_the_gpu_config_file(tmp_path) -> None:
    """freetoken/kernels/triton/configs/<gpu>.json: the exact shape's entry, else the family's
    default, else the built-in tiles; a part left out keeps the built-in one, values become ints; a
    typo'd part or key, or a file that is not JSON, fails naming the file. Bugs caught: the
    file ignored, a part it leaves out wiped, a typo'd key accepted silently, one GPU's tiles
    used on another."""
    import json

    from freetoken.kernels.triton.fused_moe import DECODE_CONFIG
    from freetoken.kernels.triton.tuned import gpu_file_name, load_file, lookup

    assert gpu_file_name("NVIDIA H200") == "nvidia_h200.json"
    assert gpu_file_name("NVIDIA GeForce RTX 4090 ") == "nvidia_geforce_rtx_4090.json"
    (tmp_path / "nvidia_h200.json").write_text(json.dumps({"fused_moe_decode": {
        "H=64,I=32": {"gate_up": {"BLOCK_N": 8, "num_warps": "8"}},
        "default": {"down": {"BLOCK_K": 64}}}}))

    def tiles(shape: str, gpu: str | None = "NVIDIA H200") -> dict:
        return lookup("fused_moe_decode", shape, DECODE_CONFIG, gpu, tmp_path)

    got = tiles("H=64,I=32")
    assert got["gate_up"] == {**DECODE_CONFIG["gate_up"], "BLOCK_N": 8, "num_warps": 8}
    assert got["down"] == DECODE_CONFIG["down"]
    assert tiles("H=128,I=32") == {**DECODE_CONFIG,
                                   "down": {**DECODE_CONFIG["down"], "BLOCK_K": 64}}
    assert tiles("H=64,I=32", "NVIDIA A100-SXM4-80GB") == DECODE_CONFIG  # no file: built-in
    assert tiles("H=64,I=32", None) == DECODE_CONFIG  # no GPU (the interpreter): built-in
    for n, bad in enumerate(({"H=1,I=1": {"gate_up": {"BLOCK_M": 8}}}, {"H=1,I=1": {"up": {}}},
                             {"H=1,I=1": ["gate_up"]})):
        name = f"bad {n}"
        (tmp_path / gpu_file_name(name)).write_text(json.dumps({"fused_moe_decode": bad}))
        with pytest.raises(ValueError, match=gpu_file_name(name)):
            tiles("H=1,I=1", name)
    (tmp_path / "not_json.json").write_text("{not json")
    with pytest.raises(ValueError, match="not_json.json"):
        load_file(tmp_path / "not_json.json")


def test_the_shipped_config_files_are_valid() -> None:
    """Every file in freetoken/kernels/triton/configs parses and each entry merges with the built-in
    tiles (a broken shipped file would fail the first decode launch on that GPU)."""
    from freetoken.kernels.triton.fused_moe import DECODE_CONFIG
    from freetoken.kernels.triton.tuned import CONFIG_DIR, load_file, merge_config

    files = sorted(CONFIG_DIR.glob("*.json"))
    assert files, "no tuned config shipped"
    for path in files:
        for shape, tuned in load_file(path).get("fused_moe_decode", {}).items():
            merged = merge_config(DECODE_CONFIG, tuned, f"{path} {shape}")
            assert set(merged) == set(DECODE_CONFIG)
