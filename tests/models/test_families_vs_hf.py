"""The checks every model family passes against transformers (the oracle), through
save_pretrained -> load_model: greedy tokens of the plain generation path, and the batched
engine (chunked prefill beside other requests' decode rows, then a second turn that reuses the
first's cached prefix: latents, KV and, for linear attention, the state snapshot) giving
transformers' greedy tokens. One test per check, parametrised by family, instead of one copy
per family file."""
from __future__ import annotations

import pytest
import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams
from tests.models.family_helpers import hf_greedy, prompt
from tests.models.fixtures import hf_reference


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3",
                                  "deepseek_v3_no_q_lora", "kimi_linear", "glm_moe_dsa"])
def test_greedy_tokens_match_transformers(tiny_hf, kind: str) -> None:
    d = tiny_hf(kind)
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    ids = prompt(ours.cfg.vocab_size, 40, seed=1)
    got = generate(ours, ids, SamplingParams(max_tokens=24, temperature=0.0), eos_ids=[])
    assert got.token_ids == hf_greedy(ref, ids, 24)


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_linear", "glm_moe_dsa"])
def test_engine_batches_and_reuses_prefix(tiny_hf, kind: str) -> None:
    """deepseek_v3: a radix cache of MLA latent slots (glm_moe_dsa: with each token's indexer
    key beside its latent, and prompts longer than index_topk); kimi_linear: KDA conv and recurrent
    state restored from the hybrid-state cache's snapshot, MLA latents from the radix tree."""
    d = tiny_hf(kind)
    model, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    V = model.cfg.vocab_size
    base = prompt(V, 70, 0)
    prompts = [base + prompt(V, 11 + 5 * i, i + 1) for i in range(3)]
    core = EngineCore(model, [], kv_tokens=1024, state_slots=8, max_running=2, chunk_tokens=32)

    def run(reqs: list[GenerateRequest]) -> dict[str, list]:
        out: dict[str, list] = {r.request_id: [] for r in reqs}
        for r in reqs:
            core.add(r, out[r.request_id].append)
        while core.has_work():
            core.step()
        return out

    def req(rid: str, ids: list[int], n: int) -> GenerateRequest:
        return GenerateRequest(ids, SamplingParams(max_tokens=n, temperature=0.0,
                                                   ignore_eos=True), request_id=rid)

    out = run([req(f"r{i}", p, 8) for i, p in enumerate(prompts)])
    want = [hf_greedy(ref, p, 8) for p in prompts]
    for i in range(3):
        assert [t for e in out[f"r{i}"] for t in e.token_ids] == want[i], i
    turn2 = prompts[0] + want[0] + prompt(V, 9, 99)
    ev = run([req("t2", turn2, 6)])["t2"]
    assert [t for e in ev for t in e.token_ids] == hf_greedy(ref, turn2, 6)
    assert ev[0].cached_tokens >= len(prompts[0]) - 1, ev[0].cached_tokens
