"""Driving an EngineCore to completion in tests: greedy tokens of a few prompts decoded together."""
from __future__ import annotations

from freetoken.engine.core import EngineCore
from freetoken.types.api import GenerateRequest, SamplingParams


def greedy_tokens(model, prompts: list[list[int]], n: int, **core_kw
                  ) -> tuple[list[list[int]], EngineCore]:
    """Each prompt's first `n` greedy tokens (end tokens ignored), all added at once to one
    EngineCore(model, **core_kw) stepped until it has no work; returns them with the core."""
    kw = {"kv_tokens": 4096, "state_slots": 16, "max_running": 4, "chunk_tokens": 64} | core_kw
    core = EngineCore(model, [], **kw)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add(GenerateRequest(p, sp, [], request_id=f"r{i}"),
                 lambda ev, i=i: out[i].extend(ev.token_ids))
    while core.has_work():
        core.step()
    return [out[i] for i in range(len(prompts))], core
