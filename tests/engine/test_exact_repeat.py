"""Exact repeat = zero recompute (#23 item 4): a resent prompt, or the prompt one token back,
reuses its whole prefix on a hybrid model and feeds no token before its first one.

Bug caught: the last position's logits were not kept, so a repeat resumed from the snapshot at
`len - 1` and recomputed its last token (and a resend one token back fell back to an earlier
snapshot). Oracle: the plain single-request path (`generate`) for the tokens; the engine's own
prefill counter for the work done.
"""
from __future__ import annotations

import torch

from freetoken.cache import HybridRadixCache, SlotAllocator, StatePool
from freetoken.engine.core import EngineCore
from freetoken.engine.generate import generate
from freetoken.models.demo import random_demo_dir
from freetoken.models.loader import load_model
from freetoken.types.api import EngineEvent, GenerateRequest, SamplingParams


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run(core: EngineCore, rid: str, ids: list[int], n: int) -> tuple[list[int], int, int]:
    """(tokens, cached_tokens, prefill tokens the engine computed for it)."""
    evs: list[EngineEvent] = []
    before = core.stats.summary()["prefill_tokens_computed"]
    core.add(GenerateRequest(ids, _greedy(n), [], request_id=rid), evs.append)
    for _ in range(10_000):
        if not core.has_work():
            break
        core.step()
    done = core.stats.summary()["prefill_tokens_computed"] - before
    return [t for e in evs for t in e.token_ids], evs[0].cached_tokens, done


def _check_repeats(model, prompt: list[int], n: int, **kw) -> None:
    want = generate(model, prompt, _greedy(n), []).token_ids
    back = generate(model, prompt[:-1], _greedy(n), []).token_ids
    core = EngineCore(model, [], **kw)
    toks, cached, done = _run(core, "first", prompt, n)
    assert toks == want and cached == 0 and done == len(prompt)
    toks, cached, done = _run(core, "repeat", prompt, n)
    assert (toks, cached, done) == (want, len(prompt), 0)
    toks, cached, done = _run(core, "one_back", prompt[:-1], n)
    assert (toks, cached, done) == (back, len(prompt) - 1, 0)
    s = core.sched.stats()
    assert s["logits_hits"] == 2 and s["running"] == 0 and s["kv_protected"] == 0
    # no kept-logits slot leaks: each is a row at a node or free
    assert s["logits_rows"] + s["logits_free"] == kw["state_slots"] and s["logits_rows"] >= 2


def test_tiny_hybrid_repeat_and_one_back_compute_nothing(tiny_hf) -> None:
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.cfg.vocab_size, (70,), generator=g).tolist()
    _check_repeats(model, prompt, 6, kv_tokens=512, state_slots=8, chunk_tokens=32)


def test_demo_random_repeat_and_one_back_compute_nothing(tmp_path_factory) -> None:
    model = load_model(random_demo_dir(tmp_path_factory.mktemp("demo")), dtype=torch.float32,
                       progress=False)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 50_000, (40,), generator=g).tolist()
    _check_repeats(model, prompt, 4, kv_tokens=256, state_slots=8, chunk_tokens=64)


def test_kept_logits_go_with_their_snapshot() -> None:
    """Cache level: the whole prompt matches only where a snapshot and a kept row sit at the
    same node; dropping the snapshot drops the row (bug it would catch: a kept row outliving its
    state would resume a repeat from a zero state). A full logits pool takes back the least
    recently used row of an unlocked node."""
    cache = HybridRadixCache(SlotAllocator(64), StatePool(4), logits_slots=1)
    ids = list(range(10))
    row = cache.alloc_kv(10)
    m = cache.match(ids)
    cache.lock(m.node)
    c = cache.commit(ids, row, m.node, 0)
    st = cache.alloc_state()
    assert cache.attach_snapshot(c.node, st, "end")
    lg = cache.alloc_logits()
    assert lg is not None and cache.attach_logits(c.node, lg)
    cache.unlock(c.node)
    hit = cache.match(ids)
    assert (hit.length, hit.reason, hit.logits_slot) == (10, "kept_logits", lg)
    assert cache.match(ids + [99]).length == 10  # a longer prompt resumes there and feeds 1
    cache.drop_snapshot(c.node)
    m2 = cache.match(ids)
    assert m2.length < 10 and m2.logits_slot == -1 and cache.logits.pool.num_free == 1
    # a row needs a snapshot at its node
    slot = cache.alloc_logits()
    assert slot is not None and not cache.attach_logits(c.node, slot)
    cache.free_logits(slot)
    # reclaim: the only slot is in use at an unlocked node and is taken back
    st = cache.alloc_state()
    assert cache.attach_snapshot(c.node, st, "end")
    first = cache.alloc_logits()
    assert first is not None and cache.attach_logits(c.node, first)
    again = cache.alloc_logits()
    assert again == first and cache.match(ids).logits_slot == -1
    cache.free_logits(again)


def test_without_kept_logits_a_repeat_recomputes_its_last_token(tiny_hf) -> None:
    """`kept_logits=0` is the old behaviour (the control: the counter does see the token)."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    prompt = list(range(5, 45))
    core = EngineCore(model, [], kv_tokens=256, state_slots=8, chunk_tokens=32, kept_logits=0)
    _run(core, "first", prompt, 3)
    _, cached, done = _run(core, "repeat", prompt, 3)
    assert (cached, done) == (len(prompt) - 1, 1)
