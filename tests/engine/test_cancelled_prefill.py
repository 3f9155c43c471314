"""A cancelled prefill keeps its completed chunks (scheduler.abort commits them as a
preemption does). Regression (issue 28): Claude Code abandons a request after 300 s without a
first byte and sends it again; the abort threw the computed prefix away, so a slow local
prefill ran twice. Oracle: the plain generation path (`engine.generate`)."""
from __future__ import annotations

import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import EngineEvent, GenerateRequest, SamplingParams
from tests.engine.test_engine_core import _prompt, _req, _run, _tokens
from tests.models.conftest import tiny_hf  # noqa: F401  (shared session fixture)


def test_resent_prompt_resumes_from_the_cancelled_prefill(tiny_hf) -> None:  # noqa: F811
    for kind in ("qwen3_5_moe", "qwen3_moe"):
        model = load_model(tiny_hf(kind), dtype=torch.float32, progress=False)
        ids = _prompt(model.cfg.vocab_size, 200, 7)
        core = EngineCore(model, [], kv_tokens=2048, state_slots=16, chunk_tokens=32)
        evs: list[EngineEvent] = []
        core.add(_req("first", ids, 4), evs.append)
        for _ in range(3):  # three 32-token chunks of 200, no token yet
            core.step()
        done = core.sched.running[0].computed
        assert 0 < done < 200 and not any(e.token_ids for e in evs)
        core.abort("first")  # the client gave up mid-prefill
        s = core.sched.stats()
        assert s["running"] == 0 and s["kv_protected"] == 0
        assert core.sched.kv_alloc.num_used == s["kv_cached"]
        out = _run(core, [_req("again", ids, 4)])
        assert out["again"][0].cached_tokens == done, (kind, out["again"][0].cached_tokens)
        want = generate(model, ids, SamplingParams(max_tokens=4, temperature=0.0,
                                                   ignore_eos=True), []).token_ids
        assert _tokens(out["again"]) == want, kind


def test_abort_after_decode_started_still_frees_its_slots(tiny_hf) -> None:  # noqa: F811
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    core = EngineCore(model, [], kv_tokens=512, state_slots=8, chunk_tokens=64)
    evs: list[EngineEvent] = []
    core.add(GenerateRequest(_prompt(model.cfg.vocab_size, 40, 3), SamplingParams(
        max_tokens=50, temperature=0.0, ignore_eos=True), [], None, "x"), evs.append)
    while not any(e.token_ids for e in evs):
        core.step()
    core.abort("x")
    s = core.sched.stats()
    assert s["running"] == 0 and s["state_free"] + s["snapshots"] == s["state_slots"]
