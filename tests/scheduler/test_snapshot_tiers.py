"""The engine with a state pool too small for the traffic: snapshots spill to the host tier and
a later request resumes from there with the same tokens as a plain run; and fair prefill: a
short prompt admitted beside a long one gets its first token within a few steps."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

import freetoken.scheduler as scheduler_pkg
from freetoken.cache.tensors import StateTensors
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.scheduler.request import Request
from freetoken.scheduler.scheduler import Scheduler
from freetoken.types.api import Anchor, GenerateRequest, SamplingParams


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _req(rid: str, ids: list[int], n: int, anchors: list[Anchor] | None = None,
         session: str | None = None) -> GenerateRequest:
    return GenerateRequest(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           anchors or [], session_key=session, request_id=rid)


def _run(core: EngineCore, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add(r, out[r.request_id].append)
    while core.has_work():
        core.step()
    return out


def test_resume_from_the_host_tier_gives_the_plain_tokens(tiny_hf) -> None:
    """Bug caught: a snapshot evicted from the device pool is lost (0 reuse) or restored from
    the wrong host slot (wrong tokens)."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    V = model.cfg.vocab_size
    slot_bytes = StateTensors.bytes_per_slot(model.cfg, torch.float32)
    core = EngineCore(model, [], kv_tokens=4096, state_slots=3, max_running=1, chunk_tokens=64,
                      state_host_mem=6 * slot_bytes)
    head, tail = _prompt(V, 50, 1), _prompt(V, 30, 2)
    _run(core, [_req("a", head + tail, 3, [Anchor(50, "turn_start", "user", cut_point=True)])])
    # other sessions' cut points (same class, newer) push a's snapshot out of the 3 device slots
    for i in range(4):
        _run(core, [_req(f"o{i}", _prompt(V, 40, 10 + i), 2,
                         [Anchor(20, "turn_start", "user", cut_point=True)])])
    s = core.sched.stats()
    assert s["snapshots_spilled"] >= 1 and s["snapshots_host"] >= 1, s
    # the edit keeps the turn's opening token (a turn_start anchor is an `<|im_start|>`, which
    # any next turn repeats): the cut is snapshotted one token in (#23)
    edited = head + tail[:1] + _prompt(V, 25, 3)
    ev = _run(core, [_req("b", edited, 5)])["b"]
    assert ev[0].cached_tokens == 51
    assert core.sched.reuse.get("resumed_host") == 1, core.sched.reuse
    want = generate(model, edited, SamplingParams(max_tokens=5, temperature=0.0,
                                                  ignore_eos=True), []).token_ids
    assert [t for e in ev for t in e.token_ids] == want
    assert core.cache_ops.counts["spill"] >= 1 and core.cache_ops.counts["restore"] == 1


def _sched_req(rid: str, n: int) -> Request:
    return Request(_req(rid, list(range(1, n + 1)), 4), sampler=None, emit=lambda e: None)


def test_short_prompt_beside_a_long_one_gets_its_first_token_within_a_few_steps() -> None:
    """Bug caught (issue 12): a 200k-token prompt took the whole chunk budget of every step, so
    a 9-token request admitted beside it waited for the whole long prefill."""
    s = Scheduler(kv_slots=300_000, state_slots=8, has_state=True, max_running=4, chunk_tokens=512)
    long, short = _sched_req("long", 200_000), _sched_req("short", 9)
    s.add(long)
    for step in range(1, 400):
        if step == 3:
            s.add(short)  # arrives while the long prompt is mid-prefill
        plan = s.schedule()
        fed = sum(i.n for i in plan.items if i.n > 1 or i.req.remaining > 1)
        assert fed <= s.chunk_tokens + 1
        done = [i.req.rid for i in plan.items if i.wants_logits]
        for it in plan.items:
            s.after_forward(it)
        if "short" in done:
            break
    assert step <= 3 + 2, f"short prompt's first logits only at step {step}"
    assert long.computed > 0 and long.computed < 200_000
    # decode rows are always served: once decoding, the short request gets a row every step
    for _ in range(5):
        short.ids.append(7)  # the token the engine sampled
        plan = s.schedule()
        assert any(i.req is short and i.n == 1 for i in plan.items)
        assert sum(i.n for i in plan.items if i.req is long) >= s.chunk_tokens - 1
        for it in plan.items:
            s.after_forward(it)


def test_scheduler_imports_no_device_state() -> None:
    """Issue 9: the scheduler plans, the engine executes. A scheduler module that imports the
    device pools or the engine (to copy a state slot itself) breaks the CUDA-graph seam."""
    banned = ("freetoken.engine", "freetoken.cache.tensors")
    for f in Path(scheduler_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(banned), (f.name, node.module)


def test_streaming_sized_chunks_are_not_split_by_interval_snapshots() -> None:
    """Bug caught (issue 13): with 8192-token chunks (prefill streaming), the semantic policy's
    interval snapshots every 4096 tokens ended every other chunk early, so a 32k prompt took
    six passes of the experts over the link instead of four."""
    s = Scheduler(kv_slots=40_000, state_slots=8, has_state=True, max_running=1, chunk_tokens=8192)
    r = _sched_req("long", 32_768)
    s.add(r)
    sizes = []
    while r.computed < 32_768:
        plan = s.schedule()
        sizes += [i.n for i in plan.items]
        for it in plan.items:
            s.after_forward(it)
    assert sizes == [8192, 8192, 8192, 8191, 1] or sizes == [8192] * 4, sizes
