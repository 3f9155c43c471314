"""The decode runner's launch/collect split: a step launched before the previous one's tokens
are read takes its input id from them on the device (`chain`). Oracle: the same runner stepped
one at a time with the ids passed from the host; and the model's own eager forward. Bugs it
catches: the chained source index pointing at the wrong row or at stale ids, the alternating
staging buffers mixing two steps' inputs, a discarded step left in flight."""
from __future__ import annotations

import pytest
import torch

from freetoken.engine.core import EngineCore
from freetoken.engine.decode_staging import DecodeRow
from freetoken.models.loader import load_model
from freetoken.types.forward_batch import ForwardBatch


def _setup(tiny_hf, rows: int):
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    core = EngineCore(model, [2], kv_tokens=512, state_slots=8, max_running=4,
                      decode_runner=True)
    prompts = [[3 + 7 * b + i for i in range(9 + b)] for b in range(rows)]
    firsts = []
    for b, p in enumerate(prompts):  # prefill each row into its own slots and state slot
        slots = torch.arange(100 * b, 100 * b + len(p))
        logits = model(ForwardBatch.single(p, 0, slots, b, torch.device("cpu")), core.caches)
        firsts.append(int(logits[0].argmax()))
    return model, core, prompts, firsts


def _row(prompts, b: int, k: int, tok: int) -> DecodeRow:
    """Row b's step that feeds its k-th generated token (k from 0)."""
    pos = len(prompts[b]) + k
    return DecodeRow(token=tok, position=pos, out_slot=100 * b + pos, state_slot=b,
                     kv_slots=torch.arange(100 * b, 100 * b + pos + 1))


def _save(core):
    st = core.caches.state
    return [t.clone() for t in st.conv + st.ssm]


def _restore(core, saved) -> None:
    st = core.caches.state
    for t, v in zip(st.conv + st.ssm, saved):
        t.copy_(v)


@pytest.mark.parametrize("rows", [1, 3])
def test_chained_steps_equal_stepwise(tiny_hf, rows: int) -> None:
    steps = 12
    _, core, prompts, firsts = _setup(tiny_hf, rows)
    r = core.runner
    state0 = _save(core)
    # one step at a time, ids through the host
    want, toks = [], list(firsts)
    for k in range(steps):
        toks = r.step([_row(prompts, b, k, toks[b]) for b in range(rows)])
        want.append(toks)
    # chained: step k+1 is launched before step k is collected; rows reversed in the chained
    # steps so that the source index must map row b to the previous step's row rows-1-b
    _restore(core, state0)
    order = list(range(rows))
    pend = r.launch([_row(prompts, b, 0, firsts[b]) for b in order])
    got = []
    for k in range(1, steps + 1):
        prev = order
        order = order[::-1]
        ahead = None
        if k < steps:
            ahead = r.launch([_row(prompts, b, k, 0) for b in order],
                             chain=[prev.index(b) for b in order])
        ids = r.collect(pend)
        got.append([ids[prev.index(b)] for b in range(rows)])
        pend = ahead
    assert got == want
    assert not r._open


def test_chained_step_after_the_end_is_discarded(tiny_hf) -> None:
    """A step launched ahead and never needed (the sequence stopped): drain() leaves nothing
    in flight, and the next unchained step is as if it had not run (its writes were to the
    row's own slot past the end, rewritten by the real step)."""
    _, core, prompts, firsts = _setup(tiny_hf, 1)
    r = core.runner
    state0 = _save(core)
    want = r.step([_row(prompts, 0, 0, firsts[0])])
    _restore(core, state0)
    p = r.launch([_row(prompts, 0, 0, firsts[0])])
    r.launch([_row(prompts, 0, 1, 0)], chain=[0])  # launched ahead, then not wanted
    assert r.collect(p) == want
    r.drain()
    assert not r._open
    with pytest.raises(AssertionError):
        r.launch([_row(prompts, 0, 1, 0)], chain=[0])  # nothing to chain from
