"""Exact resume from a state snapshot at every anchor kind, from the device tier and from the
host tier, through the real state-op executor (`engine/cache_ops.py`) on a tiny hybrid model
with the real Qwen3 vocabulary and chat template. Oracle: the logits of one full prefill.

Bugs these catch: a spill or restore that copies the wrong slot or only some layers (conv or
ssm), a conv state taken one token off the anchor, a restore that reads a host slot a later
spill overwrote."""
from __future__ import annotations

import pytest
import torch

from freetoken.cache import StateOp
from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.chat import ChatTokenizer
from freetoken.engine.cache_ops import CacheOps, HostStates
from freetoken.models.loader import load_model
from freetoken.types.forward_batch import ForwardBatch

TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent."},
    {"role": "user", "content": "What does setup.py say?"},
    {"role": "assistant", "content": "Reading it.", "reasoning_content": "I should read it.",
     "tool_calls": [{"type": "function", "function": {"name": "read",
                                                      "arguments": {"path": "setup.py"}}}]},
    {"role": "tool", "content": "from setuptools import setup\nsetup(name='x')"},
    {"role": "user", "content": "Thanks, now summarise."},
]
KINDS = ["head_end", "turn_start:user", "turn_start:assistant", "think_start", "think_end",
         "tool_call_start", "tool_result_start", "tool_result_end"]


@pytest.fixture(scope="module")
def setup(tiny_chat_dir):
    tok = ChatTokenizer.from_dir(tiny_chat_dir)
    prompt = tok.apply(MESSAGES, tools=TOOLS)
    model = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    return model, prompt


def _pos(prompt, kind: str) -> int:
    name, _, role = kind.partition(":")
    for a in prompt.anchors:
        if a.kind == name and (not role or a.role == role) and a.position >= 1:
            return a.position
    raise AssertionError(f"the rendered prompt has no {kind} anchor")


def _run(model, caches, ids, prefix, kv_slots, state_slot, rows) -> torch.Tensor:
    b = ForwardBatch.single(ids, prefix, kv_slots, state_slot)
    b.logits_rows = torch.tensor(rows, dtype=torch.long)
    with torch.no_grad():
        return model(b, caches)  # [len(rows), V]


@pytest.mark.parametrize("tier", ["device", "host"])
def test_resume_at_every_anchor_kind_matches_full_prefill(setup, tier: str) -> None:
    model, prompt = setup
    ids, L = prompt.input_ids, len(prompt.input_ids)
    cfg = model.cfg
    kvp = KVPool(cfg, 2 * L, torch.float32, "cpu")
    st = StateTensors(cfg, 3, torch.float32, "cpu")
    host = HostStates(st, 2)
    ops = CacheOps(st, host)
    caches = Caches(kvp, st)
    full_slots, part_slots = torch.arange(L, 2 * L), torch.arange(L)
    ops.run([StateOp("reset", -1, 0)])
    positions = [_pos(prompt, k) for k in KINDS]
    want = _run(model, caches, ids, 0, full_slots, 0, positions + [L - 1])  # [K + 1, V]
    for k, (kind, p) in enumerate(zip(KINDS, positions)):
        # prefill up to the anchor in working slot 0, snapshot into slot 1 (as the plan does)
        ops.run([StateOp("reset", -1, 0)])
        _run(model, caches, ids[:p], 0, part_slots[:p], 0, [p - 1])
        ops.run([StateOp("copy", 0, 1)])
        if tier == "host":  # spill, scribble over the device copy, restore into a new slot
            ops.run([StateOp("spill", 1, 1), StateOp("reset", -1, 1), StateOp("reset", -1, 0)])
            for t in st.conv + st.ssm:
                t[1].normal_()
            ops.run([StateOp("restore", 1, 2)])
        else:
            ops.run([StateOp("reset", -1, 0), StateOp("copy", 1, 2)])
        got = _run(model, caches, ids[p:], p, part_slots, 2, [0, L - 1 - p])  # [2, V]
        for g, w in zip(got, (want[k], want[-1])):
            rel = ((g - w).norm() / w.norm()).item()
            assert rel <= 1e-5, (kind, p, tier, rel)
    assert ops.counts["spill" if tier == "host" else "copy"] >= len(KINDS)
