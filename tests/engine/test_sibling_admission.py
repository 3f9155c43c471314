"""No head-of-line blocking behind a waiting sibling (#23 item 2).

Bug it catches: `_admit_waiting` stopped at the first queued request waiting for a sibling's
prefix, so every request behind it waited too (measured: an unrelated request 9.6 s instead of
1.75 s; an OpenClaw main turn 12.8 s instead of ~2.4 s)."""
from __future__ import annotations

import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import Anchor, EngineEvent, GenerateRequest, SamplingParams


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _req(rid: str, ids: list[int], n: int, anchors: list[Anchor] | None = None) -> GenerateRequest:
    return GenerateRequest(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           anchors or [], request_id=rid)


def _first_token_steps(core: EngineCore, reqs: list[GenerateRequest]
                       ) -> tuple[dict[str, int], dict[str, list[EngineEvent]]]:
    """Step index (1-based) at which each request got its first token."""
    out: dict[str, list[EngineEvent]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add(r, out[r.request_id].append)
    first: dict[str, int] = {}
    step = 0
    while core.has_work():
        core.step()
        step += 1
        for rid, evs in out.items():
            if rid not in first and any(e.token_ids for e in evs):
                first[rid] = step
        assert step < 5000
    return first, out


def test_unrelated_request_is_admitted_around_a_waiting_sibling(tiny_hf) -> None:
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    head = _prompt(V, 400, 1)  # the siblings' shared head: many chunks of prefill
    a, b = head + _prompt(V, 20, 2), head + _prompt(V, 25, 3)
    c = _prompt(V, 40, 4)  # unrelated, short
    anchors = [Anchor(400, "turn_start", "user")]

    def core() -> EngineCore:
        return EngineCore(model, [], kv_tokens=2048, state_slots=16, max_running=4,
                          chunk_tokens=16)

    alone, _ = _first_token_steps(core(), [_req("a", a, 4, anchors), _req("c", c, 4)])
    beside, out = _first_token_steps(core(), [_req("a", a, 4, anchors),
                                              _req("b", b, 4, anchors), _req("c", c, 4)])
    # b really waited for a's head (else the test would not exercise the waiting path)
    assert out["b"][0].cached_tokens >= 400 - 1
    assert beside["b"] > alone["a"] - 1
    assert beside["c"] <= alone["c"] + 1, (alone, beside)
    for rid, p in (("a", a), ("b", b), ("c", c)):
        want = generate(model, p, SamplingParams(max_tokens=4, temperature=0.0,
                                                 ignore_eos=True), []).token_ids
        assert [t for e in out[rid] for t in e.token_ids] == want, rid
