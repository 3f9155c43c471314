"""The demo trainer's machinery (`train_demo`, `train_kernels`): the kernel check that guards
the fla path on the GPU, padding that cannot change the loss, the wall-clock plan, and the data
generator's v4 property that what a call holds can only be copied from the request."""
from __future__ import annotations

import collections
import math
import random

import numpy as np
import pytest
import torch

from freetoken.models import demo_data as dd
from freetoken.models import train_demo as td
from freetoken.models import train_kernels as tk


def _gva_torch(query, key, value, g, beta, **kw):
    """A correct GVA kernel: transformers' torch form with the key heads repeated inside."""
    n = value.shape[2] // key.shape[2]
    return tk.torch_reference()(query.repeat_interleave(n, 2), key.repeat_interleave(n, 2),
                                value, g=g, beta=beta, **kw)


def _tiled_heads(query, key, value, g, beta, **kw):
    """Wrong head grouping: value head i reads key head i % H (repeat, not repeat_interleave)."""
    n = value.shape[2] // key.shape[2]
    return tk.torch_reference()(query.repeat(1, 1, n, 1), key.repeat(1, 1, n, 1), value, g=g,
                                beta=beta, **kw)


def _no_gate(query, key, value, g, beta, **kw):
    """Wrong gate units: the decay ignored."""
    return _gva_torch(query, key, value, torch.zeros_like(g), beta, **kw)


def test_kernel_check_passes_a_correct_kernel_and_fails_wrong_ones() -> None:
    """Bug this catches: a check too loose (or comparing a function with itself) to stop the
    GPU run from training with a kernel of other semantics than the engine's."""
    ok = tk.check_against_torch(_gva_torch, "cpu")
    assert set(ok) == {"out", "query", "key", "value", "g", "beta"}
    assert max(ok.values()) < 1e-5, ok
    ok16 = tk.check_against_torch(_gva_torch, "cpu", "bfloat16")
    assert max(ok16.values()) < 0.1, ok16
    for wrong in (_tiled_heads, _no_gate):
        err = tk.check_against_torch(wrong, "cpu", "bfloat16")
        assert max(err.values()) > 0.3, (wrong.__name__, err)


def test_use_torch_installs_the_form_the_model_calls() -> None:
    tk.block_optional_kernels("torch")
    kernel, calls = tk.use("auto", "cpu", say=lambda _line: None)
    assert kernel == "torch"
    model = td.build_model(40, seed=0)
    with torch.no_grad():
        model.model(input_ids=torch.randint(0, 40, (1, 70)), use_cache=False)
    assert calls[0] == 2  # one per linear-attention layer


def test_autotune_trim_cuts_only_fla_kernels() -> None:
    triton = pytest.importorskip("triton")
    tk._trim_autotune(1)

    def kernel(x):
        pass

    def make(module: str):
        kernel.__module__ = module
        jit = triton.jit(kernel)
        cfgs = [triton.Config({}, num_warps=w) for w in (1, 2, 4)]
        return triton.autotune(configs=cfgs, key=[])(jit)

    assert len(make("fla.ops.fake").configs) == 1
    assert len(make("tests.models.fake").configs) == 3


def test_padding_never_changes_the_loss() -> None:
    """Bug this catches: right padding that reaches a target (a non-causal path, or a mask
    that covers a pad): the loss with lengths padded to 64 equals the loss unpadded."""
    rng = np.random.default_rng(0)
    lens = np.array([37, 50, 21])
    data = {"ids": rng.integers(0, 30, lens.sum()).astype(np.uint16),
            "mask": (rng.random(lens.sum()) < 0.4).astype(np.uint8), "lens": lens,
            "offsets": np.concatenate([[0], np.cumsum(lens)])}
    model = td.build_model(31, seed=0)
    out = []
    for pad in (1, 64):
        inputs, targets, mask = td.make_batch(data, [0, 1, 2], np.random.default_rng(1), 30,
                                              0.0, pad_to=pad)
        assert inputs.shape[1] == (50 if pad == 1 else 64)
        with torch.no_grad():
            out.append(td.loss_fn(model, inputs, targets, mask, math.log(1000)).item())
    assert abs(out[0] - out[1]) < 1e-5 * abs(out[0])


def test_lr_warmup_does_not_depend_on_the_plan() -> None:
    """A planned run and its `--steps N` rerun share every lr: warm-up before the plan exists."""
    assert [td.lr_at(s, None, 1.0, 10) for s in range(10)] == [
        td.lr_at(s, 500, 1.0, 10) for s in range(10)]
    assert td.lr_at(10, 500, 1.0, 10) == pytest.approx(1.0)
    assert td.lr_at(500, 500, 1.0, 10) == pytest.approx(0.1)


def test_plan_weighs_each_harness_by_how_often_it_comes() -> None:
    log = ([{"harness": "slow", "step_s": 9.0}] * 2 + [{"harness": "a", "step_s": 1.0}] * 6
           + [{"harness": "b", "step_s": 3.0}] * 4)
    steps, rate = td.plan_steps(log, 2, 105.0, {"a": 1.0, "b": 1.0})
    assert rate == pytest.approx(2.0 * 1.05)  # the compile-time first steps are skipped
    assert steps == len(log) + int(105.0 / rate)


def test_what_a_call_holds_can_only_come_from_the_request() -> None:
    """Bug this catches (the v3 data): working directories from 19, README.md in ~60% of read
    tasks, so a model that wrote `/home/sam/web/README.md` whatever it was asked scored well
    and never learned to copy. v4: no path, directory or file is common."""
    corpus = dd.corpus_lines()
    h = dd.HARNESSES["claude_code"]
    cwds, paths, dirs = collections.Counter(), collections.Counter(), 0
    for seed in range(300):
        body, tasks = dd.conversation(h, random.Random(seed), corpus=corpus)
        ti = dd.template_input(h, body)
        cwds[_cwd_of(ti)] += 1
        for t in tasks:
            if t.kind == "read":
                paths[t.path] += 1
            dirs += t.kind == "list" and bool(t.path)
    assert cwds.most_common(1)[0][1] < 0.05 * 300, cwds.most_common(3)
    assert paths.most_common(1)[0][1] < 0.2 * sum(paths.values()), paths.most_common(3)
    assert dirs > 20


def _cwd_of(ti) -> str:
    """The working directory Claude Code's system prompt states."""
    text = next(m["content"] for m in ti.messages if "Primary working directory: " in str(
        m["content"]))
    return str(text).split("Primary working directory: ", 1)[1].split("\n", 1)[0]


@pytest.mark.parametrize("name", ["mini_tool", "mini_text"])
def test_short_mini_conversations_cut_only_the_instructions(name: str) -> None:
    """The short variant is the same conversation (same tasks, calls, results, answers) with
    mini's first user message cut to its task line; the full one keeps the instructions."""
    corpus = dd.corpus_lines()
    h, short = dd.harness_of(name + dd.SHORT)
    assert short and h is dd.HARNESSES[name]
    for seed in range(5):
        full, tasks = dd.conversation(h, random.Random(seed), corpus=corpus)
        cut, tasks2 = dd.conversation(h, random.Random(seed), corpus=corpus, short=True)
        assert [t.request for t in tasks] == [t.request for t in tasks2]
        users = [i for i, m in enumerate(full["messages"]) if m["role"] == "user"]
        line = f"Please solve this issue: {tasks[0].request}"
        assert cut["messages"][users[0]]["content"] == line
        assert full["messages"][users[0]]["content"].startswith(line + "\n\n")
        assert len(full["messages"][users[0]]["content"]) > 1000
        assert ([m for i, m in enumerate(full["messages"]) if i != users[0]]
                == [m for i, m in enumerate(cut["messages"]) if i != users[0]])
