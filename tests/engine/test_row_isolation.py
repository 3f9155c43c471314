"""No request can fail another (issue 22, item 3): a row of a batch that cannot be sampled fails
its own request only; the other rows finish with the tokens they get alone."""
from __future__ import annotations

import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.sampler import RequestSampler, RowFailure
from freetoken.types.api import GenerateRequest, SamplingParams

N = 6


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (7 + 3 * i,), generator=g).tolist() for i in range(4)]


def _run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]
         ) -> tuple[list[list[int]], list[object]]:
    out: list[list[int]] = [[] for _ in prompts]
    errors: list[object] = [None] * len(prompts)

    def emit(ev: object, i: int) -> None:
        if isinstance(ev, BaseException):
            errors[i] = ev
        else:
            out[i].extend(ev.token_ids)  # type: ignore[attr-defined]

    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add(GenerateRequest(p, sp, request_id=str(i)), lambda ev, i=i: emit(ev, i))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 500
    return out, errors


def test_one_poisoned_row_in_a_batch_of_four_fails_alone(tiny_hf) -> None:
    """Was: temperature 1e-300 made the sampler raise inside the batched step and every
    co-batched request was aborted. Request 1 is poisoned twice over here: a subnormal
    temperature (now sampled at MIN_TEMPERATURE, so it finishes) and, in the second run, a
    model row whose logits come out NaN (it fails; the others do not notice)."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    prompts = _prompts(model.cfg.vocab_size)
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    alone = [generate(model, p, greedy, []).token_ids for p in prompts]

    tiny = SamplingParams(max_tokens=N, temperature=1e-300, top_p=5e-324, ignore_eos=True)
    core = EngineCore(model, [], kv_tokens=2048, state_slots=16, max_running=4)
    got, errors = _run(core, prompts, [greedy, tiny, greedy, greedy])
    assert errors == [None] * 4
    assert [got[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert got[1] == alone[1]  # the clamped temperature is as good as greedy here

    real = RequestSampler.sample

    def nan_for_request_1(self: RequestSampler, logits: torch.Tensor, n: int) -> int:
        if self.params.seed == 1 and n == 2:
            logits = torch.full_like(logits, float("nan"))
        return real(self, logits, n)

    RequestSampler.sample = nan_for_request_1  # type: ignore[method-assign]
    try:
        core = EngineCore(model, [], kv_tokens=2048, state_slots=16, max_running=4)
        marked = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, seed=1)
        got, errors = _run(core, prompts, [greedy, marked, greedy, greedy])
    finally:
        RequestSampler.sample = real  # type: ignore[method-assign]
    assert isinstance(errors[1], RowFailure) and len(got[1]) == 2
    assert [errors[i] for i in (0, 2, 3)] == [None] * 3
    assert [got[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert not core.sched.running and not core.sched.waiting  # the failed row left nothing


def test_sampler_never_raises_on_parameters_that_pass_validation() -> None:
    """Every extreme the validation lets through draws a token from finite logits."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 30
    for t in (1e-300, 5e-324, 1e-45, 1e-5, 100.0):
        for top_p in (5e-324, 1e-300, 0.5, 1.0):
            for top_k in (0, 1, 999):
                s = RequestSampler(SamplingParams(max_tokens=4, temperature=t, top_p=top_p,
                                                  top_k=top_k, seed=3), [])
                tok = s.sample(logits, 0)
                assert 0 <= tok < 1000
    s = RequestSampler(SamplingParams(max_tokens=4, temperature=1e-300, seed=3), [])
    assert s.sample(logits, 0) == int(logits.argmax())
