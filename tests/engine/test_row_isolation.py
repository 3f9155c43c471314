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


# -- failures that depend on a row's content: a poison token P ----------------------------------


def _poison_token(alone: list[list[int]], prompts: list[list[int]], victim: int
                  ) -> tuple[int, int]:
    """(P, k): P = the victim's k-th greedy token alone, seen nowhere else (no other prompt or
    output, not earlier in the victim's), so only the victim's row ever carries P as input."""
    others = {t for i, p in enumerate(prompts) for t in p + (alone[i] if i != victim else [])}
    for k in range(1, len(alone[victim]) - 1):
        p = alone[victim][k]
        if p not in others and p not in alone[victim][:k] + prompts[victim]:
            return p, k
    raise AssertionError("no token of the victim's is its own; change the prompts' seed")


def _poisoned_run(tiny_hf, poison, decode_runner: bool, device_sampler: bool) -> None:
    """Request 1 of four is poisoned by `poison(model, P)`; the others finish as alone, the
    victim fails after k + 1 tokens, and the engine serves a fresh request as alone after."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    prompts = _prompts(model.cfg.vocab_size)
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    alone = [generate(model, p, greedy, []).token_ids for p in prompts]
    P, k = _poison_token(alone, prompts, 1)
    poison(model, P)
    core = EngineCore(model, [], kv_tokens=2048, state_slots=16, max_running=4,
                      decode_runner=decode_runner)
    core.eager.device_sampler = device_sampler
    got, errors = _run(core, prompts, [greedy] * 4)
    assert isinstance(errors[1], RowFailure), errors
    assert got[1] == alone[1][:k + 1]
    assert [errors[i] for i in (0, 2, 3)] == [None] * 3
    assert [got[i] for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]
    assert not core.sched.running and not core.sched.waiting and not core.sched.alone
    again, errors = _run(core, prompts[3:], [greedy])
    assert errors == [None] and again == alone[3:]


def _nan_logits_after(model, P: int) -> None:
    real = model.forward

    def forward(batch, caches):
        logits = real(batch, caches)
        hit = batch.input_ids[batch.logits_rows] == P  # [R]
        return torch.where(hit[:, None], float("nan"), logits)

    model.forward = forward


def _raise_in_last_layer(model, P: int) -> None:
    """The last layer raises when any row feeds P: every earlier layer has updated the
    recurrent state of every row of the batch by then."""
    layer = model.model.layers[-1]
    real = layer.forward

    def forward(x, cos, sin, batch, *a, **kw):
        if bool((batch.input_ids == P).any()):
            raise RuntimeError("injected: this row breaks the layer")
        return real(x, cos, sin, batch, *a, **kw)

    layer.forward = forward


def test_nan_row_on_the_device_sampler_path_yields_no_token(tiny_hf) -> None:
    """Was: the device sampler (CUDA's path: gpu_sampler, prefill and the decode runner) took
    the argmax of a NaN row and streamed that token; only the CPU sampler refused it. Forced
    here on the CPU: `device_sampler` and the decode runner (eager, chained steps)."""
    _poisoned_run(tiny_hf, _nan_logits_after, decode_runner=True, device_sampler=True)


def test_device_sampler_marks_only_the_non_finite_rows() -> None:
    from freetoken.engine.gpu_sampler import FAILED_ROW, RowSampling, sample_rows

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 3] = float("-inf")  # some -inf (blocked ids look like this): still sampled
    for t in (0.0, 0.7):
        rows = [RowSampling(temperature=t, seed=i) for i in range(4)]
        ids = sample_rows(logits, rows, torch.device("cpu"))
        assert ids[1] == ids[2] == FAILED_ROW and min(ids[0], ids[3]) >= 0
        over = logits.clone()
        over[0, 9] = float("inf")  # an overflow is a failed computation too
        assert sample_rows(over, rows, torch.device("cpu"))[0] == FAILED_ROW
        if t == 0.0:
            assert [ids[0], ids[3]] == [int(logits[0].argmax()), int(logits[3].argmax())]


def test_a_failed_forward_fails_only_the_request_that_breaks_it(tiny_hf) -> None:
    """Was: an exception in the forward pass failed every request of the batch (AsyncEngine
    aborted them all). Now the rows are re-run alone from their cached prefix; only the one
    whose input breaks the layer fails, the other three keep their greedy tokens."""
    _poisoned_run(tiny_hf, _raise_in_last_layer, decode_runner=False, device_sampler=False)


def test_a_failed_chained_decode_step_fails_only_its_culprit(tiny_hf) -> None:
    """The same through the decode runner's overlapped (chained) steps, where the failing
    launch is the step ahead of one whose tokens are still to be read."""
    _poisoned_run(tiny_hf, _raise_in_last_layer, decode_runner=True, device_sampler=False)
