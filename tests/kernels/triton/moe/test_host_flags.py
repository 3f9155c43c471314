"""The bridge's hand-off kernels (freetoken/kernels/triton/host_flags.py) against plain torch:
store_rows copies a layer's inputs into the host buffers, merge_rows takes exactly the masked rows
of the host results into y, and wait_flag returns at once for an empty mask and gives up (err = 1)
when a needed flag never comes. Under TRITON_INTERPRET=1 on a CPU-only machine (every tensor on
the CPU: the "host" buffers are plain tensors there); on CUDA with pinned host buffers."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from freetoken.kernels.triton.host_flags import merge_rows, store_rows, wait_flag

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _host(*shape, dtype):
    return torch.zeros(*shape, dtype=dtype, pin_memory=CUDA)


@pytest.mark.parametrize("T,H", [(1, 40), (3, 2500)])  # 2500: more than one block of x
def test_store_rows_copies_inputs(T: int, H: int) -> None:
    K = 4
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(-1, 9, (T, K), generator=g)
    mask = torch.rand(T, K, generator=g) < 0.5
    hx, hids, hmask = _host(T + 2, H, dtype=torch.float32), _host(T + 2, K, dtype=torch.int64), \
        _host(T + 2, K, dtype=torch.bool)
    store_rows(x.to(DEV), ids.to(DEV), mask.to(DEV), hx[:T], hids[:T], hmask[:T])
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(hx[:T], x) and torch.equal(hids[:T], ids) and torch.equal(hmask[:T], mask)
    assert not hx[T:].any() and not hmask[T:].any()  # nothing past the rows


def test_merge_rows_takes_only_masked_rows() -> None:
    T, K, H = 2, 3, 1100
    g = torch.Generator().manual_seed(1)
    y = torch.randn(T, K, H, generator=g)
    host = _host(T, K, H, dtype=torch.float32)
    host.copy_(torch.randn(T, K, H, generator=g))
    mask = torch.tensor([[True, False, False], [False, True, True]])
    want = torch.where(mask[..., None], host, y)
    got = merge_rows(y.to(DEV), host, mask.to(DEV)).cpu()
    assert torch.equal(got, want)


def test_wait_skips_an_empty_mask_and_fails_a_missing_flag() -> None:
    flags = _host(2, dtype=torch.int64)
    flags.fill_(-1)
    seq = torch.tensor([5], device=DEV)
    err = torch.zeros(1, dtype=torch.int32, device=DEV)
    wait_flag(flags, 0, seq, err, need=torch.zeros(1, 4, dtype=torch.bool, device=DEV),
              max_polls=50)
    assert int(err) == 0  # nothing needed: no wait, no error
    flags[1] = 5
    wait_flag(flags, 1, seq, err, need=torch.ones(1, 4, dtype=torch.bool, device=DEV))
    assert int(err) == 0  # the flag is there
    wait_flag(flags, 0, seq, err, need=torch.tensor([[False, True]], device=DEV), max_polls=50)
    assert int(err) == 1  # needed and never raised: gives up, reports
