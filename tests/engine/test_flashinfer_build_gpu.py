"""flashinfer's decode module built and loaded outside the request path (issue #24 item 2;
engine/attention_build.py), against the real flashinfer: after `flashinfer_build` the module
reads as built, `flashinfer_load` loads it into flashinfer's own cache under the key the
decode wrapper plans with (the wrapper's first `plan` then builds and loads nothing: the
cache sees no new miss), and that plan's output equals a float64 reference of paged decode
attention. Bug caught: a build of a module other than the one `plan` loads (a different
dtype, index type or template flag in the key), which would leave the JIT on the request path
after the switch. (flashinfer is imported in the test: without it, or without CUDA, the test
is collected and skips.)"""
from __future__ import annotations

import pytest
import torch

from freetoken.engine.attention_build import (
    flashinfer_build,
    flashinfer_built,
    flashinfer_load,
)
from freetoken.engine.attention_plans import FlashInferDecode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("head_dim", [256])  # Qwen3.5/3.6 full attention (a build: minutes)
def test_built_module_is_the_one_the_wrapper_plans(head_dim: int) -> None:
    pytest.importorskip("flashinfer")
    from flashinfer.prefill import get_batch_prefill_module

    dt, B, Hq, Hk, S = torch.bfloat16, 2, 8, 2, 64
    flashinfer_build(dt, head_dim)
    assert flashinfer_built(dt, head_dim)
    flashinfer_load(dt, head_dim)
    misses = get_batch_prefill_module.cache_info().misses
    dev = torch.device("cuda")
    lens = [5, 23]
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(S, Hk, head_dim, generator=g, device=dev).to(dt)
    v = torch.randn(S, Hk, head_dim, generator=g, device=dev).to(dt)
    q = torch.randn(B, Hq, head_dim, generator=g, device=dev).to(dt)
    slots = [torch.arange(3, 3 + lens[0]), torch.arange(30, 30 + lens[1])]
    indptr_host = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    indptr = indptr_host.to(dev)
    indices = torch.zeros(S, dtype=torch.int32, device=dev)
    indices[:sum(lens)] = torch.cat(slots).to(dev, torch.int32)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    scale = head_dim ** -0.5
    plan = FlashInferDecode(B, indptr, indices, Hq, Hk, head_dim, dt, scale, ws)
    plan.prepare(indptr_host, sum(lens))
    out = plan.run(q, k, v, scale).double()  # [B, Hq, D]
    assert get_batch_prefill_module.cache_info().misses == misses  # nothing built in plan()
    r = Hq // Hk
    for b, sl in enumerate(slots):
        kk = k[sl.to(dev)].double().repeat_interleave(r, 1)  # [L, Hq, D]
        vv = v[sl.to(dev)].double().repeat_interleave(r, 1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[b].double(), kk) * scale, -1)
        want = torch.einsum("hl,lhd->hd", w, vv)
        assert torch.allclose(out[b], want, atol=2e-2, rtol=2e-2)
