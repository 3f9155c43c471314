"""Streamed prefill through the whole model and the engine, on the CPU device (the streamer's
buffers are CPU slots): fp32 results bit-identical to `fused`, also when a prefill chunk and a
running decode share a step, and after a cache resize between two chunks."""
from __future__ import annotations

import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams
from freetoken.types.config import MoEConfig

SLOTS = 2 * 8 + 3  # the tiny model has 8 experts per layer: two buffers and a few residents


def _models(tiny_hf, **opts):
    d = tiny_hf("qwen3_5_moe")
    fused = load_model(d, dtype=torch.float32, progress=False)
    moe = MoEConfig(backend="offload", cache_size=SLOTS, prefill_stream="on",
                    prefill_stream_tokens=8, **opts)
    return fused, *load_with_experts(d, moe, dtype=torch.float32, progress=False)


def test_streamed_prefill_logits_equal_fused(tiny_hf, caplog) -> None:
    fused, m, rt = _models(tiny_hf)
    prompt = list(range(3, 60))
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with caplog.at_level("INFO", logger="ft"):
        got = generate(m, prompt, sp, [], moe=rt)
    want = generate(fused, prompt, sp, [])
    assert got.token_ids == want.token_ids
    assert rt.streamer.chunks >= 1 and rt.counters.streamed > 0
    assert "prefill_path" in caplog.text and "path=stream" in caplog.text
    assert "path=experts" not in caplog.text or "reason=below_threshold" in caplog.text


def _run_engine(model, schedule, resize=None, moe=None) -> dict[str, list[int]]:
    """Request A decodes while B's long prompt is prefilled in chunks in the same steps."""
    core = EngineCore(model, [], kv_tokens=512, state_slots=8, max_running=4, chunk_tokens=16,
                      moe=moe)
    out: dict[str, list[int]] = {"a": [], "b": []}

    def emit(rid):
        return lambda ev: out[rid].extend(ev.token_ids)

    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    core.add(GenerateRequest(list(range(5, 14)), sp, request_id="a"), emit("a"))
    steps = 0
    while core.has_work():
        if steps == schedule:
            core.add(GenerateRequest(list(range(20, 90)), sp, request_id="b"), emit("b"))
        if resize is not None and steps == schedule + 2:
            core.resize_experts(slots=resize)
        core.step()
        steps += 1
    return out


def test_mixed_batch_and_resize_equal_fused(tiny_hf) -> None:
    fused, m, rt = _models(tiny_hf, prefill_overlap=False)
    want = _run_engine(fused, schedule=3)
    got = _run_engine(m, schedule=3, resize=SLOTS + 5, moe=rt)
    assert got == want and len(got["a"]) == len(got["b"]) == 20
    assert rt.cache.num_slots == SLOTS + 5
    assert rt.streamer.chunks >= 3  # B's 70 tokens in chunks of <= 16 (+ A's rows)


def test_warm_up_leaves_a_clean_engine_that_serves_the_same_tokens(tiny_hf) -> None:
    """`ft serve` warms up on CUDA before its first request (kernel compilation and graph
    capture took 37-47 s of the first request's TTFT on the H200). The warm-up must leave no
    request running, empty step statistics, and change no later result."""
    d = tiny_hf("qwen3_5_moe")
    model = load_model(d, dtype=torch.float32, progress=False)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core = EngineCore(model, [], kv_tokens=256, state_slots=8, max_running=2)
    assert core.warm_up() >= 0
    assert not core.has_work() and core.stats.summary()["requests"] == 0
    got: list[int] = []
    core.add(GenerateRequest(list(range(30, 50)), sp, request_id="x"),
             lambda ev: got.extend(ev.token_ids))
    while core.has_work():
        core.step()
    assert got == generate(model, list(range(30, 50)), sp, []).token_ids
