"""On the GPU (issue 25): quantized slots filled by the device from the pinned store through its
mapped address (freetoken/kernels/triton/uva_fill.py `fill_banks`), eagerly and replayed in a CUDA
graph, byte for byte what the host-driven copy gives; the offload backend over a quantized store
takes that path (capturable) and its greedy tokens are fused's."""
from __future__ import annotations

import pytest
import torch

from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.store import ExpertStore
from freetoken.kernels.quant import quantize_bank
from freetoken.types.model_config import ExpertFormat

pytestmark = pytest.mark.gpu

L, E, H, I, S = 2, 16, 256, 128, 6


def _store(fmt: str, block: int) -> ExpertStore:
    g = torch.Generator().manual_seed(5)
    gu = [quantize_bank(torch.randn(E, 2 * I, H, generator=g), fmt, block, 2) for _ in range(L)]
    dn = [quantize_bank(torch.randn(E, H, I, generator=g), fmt, block, 1) for _ in range(L)]
    return ExpertStore(gu, dn, pin=True)


def _same(a: SlotCache, b: SlotCache) -> bool:
    return all(torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8))
               and torch.equal(x.scale.view(torch.uint8), y.scale.view(torch.uint8))
               for x, y in ((a.gate_up_slots, b.gate_up_slots), (a.down_slots, b.down_slots)))


@pytest.mark.parametrize("fmt,block", [("fp8", 128), ("mxfp4", 32)])
def test_quantized_fill_device_eager_and_in_a_graph(fmt: str, block: int) -> None:
    store = _store(fmt, block)
    ef = ExpertFormat(fmt, block)
    host, dev = (SlotCache(L, E, H, I, S, torch.bfloat16, "cuda", impl="triton", fmt=ef)
                 for _ in range(2))
    assert dev.can_fill_on_device(store)
    g = torch.Generator().manual_seed(1)
    for step in range(4):  # eager
        ids = torch.randint(0, E, (2, 4), generator=g).cuda()
        dh, dd = host.decide(step % L, ids), dev.decide(step % L, ids)
        host.fill(step % L, dh.fetch_experts, dh.fetch_slots, store)
        dev.fill_device(step % L, dd.fetch_experts, dd.fetch_slots, store)
        torch.cuda.synchronize()
        assert _same(host, dev), step
    # captured: fixed lists' storage, new contents before each replay
    experts = torch.full((4,), -1, dtype=torch.int64, device="cuda")
    slots = torch.full((4,), -1, dtype=torch.int64, device="cuda")
    dev.fill_device(0, experts, slots, store)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dev.fill_device(0, experts, slots, store)
    for e_list, s_list in (([3, 7, -1, 1], [0, 5, -1, 2]), ([15, -1, 0, 9], [4, -1, 1, 3])):
        experts.copy_(torch.tensor(e_list))
        slots.copy_(torch.tensor(s_list))
        graph.replay()
        host.fill(0, experts, slots, store)
        torch.cuda.synchronize()
        assert _same(host, dev), e_list


def test_offload_over_fp8_takes_the_device_fill(tiny_hf, tmp_path) -> None:
    from freetoken.cli.build import load_with_experts
    from freetoken.engine.generate import generate
    from freetoken.models.loader import load_model
    from freetoken.types.api import SamplingParams
    from freetoken.types.config import MoEConfig
    from tests.models.test_fp8_vs_hf import _write_fp8

    _write_fp8(tiny_hf("qwen3_5_moe"), tmp_path / "ckpt", tmp_path / "dequantized", 128)
    m, rt = load_with_experts(tmp_path / "ckpt", MoEConfig(backend="offload", cache_size=6),
                              dtype=torch.float32, device="cuda", progress=False)
    assert all(b.device_fill for b in rt.backends)
    fused = load_model(tmp_path / "ckpt", dtype=torch.float32, device="cuda", progress=False)
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    assert (generate(m, ids, sp, [], moe=rt).token_ids
            == generate(fused, ids, sp, []).token_ids)
