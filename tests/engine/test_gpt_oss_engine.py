"""gpt-oss through the batched engine on the CPU: the decode runner (per-row slot lists, padded
buckets, sink attention over each row's window) and, for the slot backends, the captured
step's CPU share through the bridge's worker (which reads the runtime's host copy of the
experts' biases): the same tokens as the eager engine, which itself equals transformers'
greedy decoding of each prompt (prefix reuse across requests included)."""
from __future__ import annotations

import sys

sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import pytest
import torch

from freetoken.cli.build import load_with_experts
from freetoken.engine.core import EngineCore
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams
from freetoken.types.config import MoEConfig
from tests.engine.test_decode_runner import _prompt, _run
from tests.models.fixtures_gpt_oss import build_gpt_oss, gpt_oss_reference


@pytest.fixture(scope="module")
def mx_ckpt(tmp_path_factory):
    d = build_gpt_oss(tmp_path_factory.mktemp("gpt-oss-engine"), mxfp4=True)
    return d, gpt_oss_reference(d)


def _reqs(V: int) -> list[GenerateRequest]:
    base = _prompt(V, 14, 0)  # a shared head: the second request reuses its KV
    prompts = [base + _prompt(V, 3 + 5 * i, i + 1) for i in range(3)]
    return [GenerateRequest(p, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
                            request_id=f"g{i}") for i, p in enumerate(prompts)]


def test_engine_equals_transformers_greedy(mx_ckpt) -> None:
    d, ref = mx_ckpt
    model = load_model(d, dtype=torch.float32, progress=False)
    reqs = _reqs(model.cfg.vocab_size)
    core = EngineCore(model, [2], kv_tokens=256, state_slots=4, max_running=4,
                      chunk_tokens=8, decode_runner=True)
    got = _run(core, reqs)
    for r in reqs:
        with torch.no_grad():
            want = ref.generate(torch.tensor([r.input_ids]), max_new_tokens=9,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got[r.request_id] == want[0, len(r.input_ids):].tolist()
    assert core.runner is not None and core.runner.steps > 5


@pytest.mark.parametrize("backend", ["hybrid", "cpu"])
def test_runner_slot_backends_equal_eager(mx_ckpt, backend: str) -> None:
    d, _ = mx_ckpt
    model, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=5),
                                  dtype=torch.float32, progress=False)
    reqs = _reqs(model.cfg.vocab_size)
    eager = _run(EngineCore(model, [2], kv_tokens=256, state_slots=4, max_running=4,
                            chunk_tokens=8, decode_runner=False, moe=rt), reqs)
    core = EngineCore(model, [2], kv_tokens=256, state_slots=4, max_running=4,
                      chunk_tokens=8, decode_runner=True, moe=rt)
    assert _run(core, reqs) == eager
    runner = core.runner
    assert runner is not None and runner.bridge is not None
    assert runner.bridge.native is None  # the biased experts take the Python loop
    assert runner.bridge.seq == runner.steps > 5
    assert rt.counters.as_dict()["cpu_experts"] > 0
