"""The trained demo model ("demo"): its shipped weights, their exact expansion, our engine
against transformers on it, and what it was trained for: on held-out synthetic requests it ends
its turn within a bounded number of tokens, and a tool call it makes parses and validates
against the request's own tool schema, also through the OpenAI and Anthropic APIs."""
from __future__ import annotations

import sys

sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from freetoken.chat.tokenizer import ChatTokenizer
from freetoken.chat.tool_parsers import parse_tool_call
from freetoken.engine.generate import generate
from freetoken.models import demo_data as dd
from freetoken.models import demo_trained as dt
from freetoken.models.demo import demo_model_dir, demo_vocab_size
from freetoken.models.loader import load_model
from freetoken.models.train_demo import TRAIN_VERSION
from freetoken.server.state import compacted
from freetoken.types.api import SamplingParams

HELD_OUT_SEED = 12345  # the shipped weights were trained on seed 0's samples
# held-out requests are of the data version the shipped weights were trained on (not the
# generator's newest), rendered by the server through the compaction their manifest declares
DATA_VERSION, COMPACTION = dt.trained_data()
MAX_TURN = 160  # tokens: the longest trained turn (a three-line quote) is well under this


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_model_dir(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="module")
def model(demo_dir: Path):
    return load_model(demo_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(demo_dir)


def test_shipped_weights_are_small_checksummed_and_current() -> None:
    man = dt.manifest()
    path = dt.WEIGHTS_DIR / dt.COMPACT
    assert dt.sha256_file(path) == man["sha256"]
    assert path.stat().st_size == man["bytes"] < 12e6
    assert (dt.WEIGHTS_DIR / "loss.png").stat().st_size > 1000
    # weights trained on a data version the generator no longer makes must be retrained; the
    # manifest declares the compaction that version's data was rendered through
    assert DATA_VERSION in dd.DATA_VERSIONS
    assert man["prompt_compaction"] == COMPACTION == dd.COMPACTION_OF[DATA_VERSION]
    assert man["train"]["train_version"] == TRAIN_VERSION
    assert man["train"]["final_loss"] < man["train"]["first_loss"] / 4


def test_vocab_expansion_is_the_trained_softmax(demo_dir: Path) -> None:
    """Every unused id carries the shared row, so the full softmax equals the compact one the
    model was trained with (shared logit counted once per unused id)."""
    compact = load_file(str(dt.WEIGHTS_DIR / dt.COMPACT))
    used = compact["used_ids"].long()
    full = load_file(str(demo_dir / "model.safetensors"))
    V = demo_vocab_size()
    for name in dt.VOCAB_TENSORS:
        assert full[name].shape[0] == V
        assert torch.equal(full[name][used], compact[name][:-1])
        rest = torch.ones(V, dtype=torch.bool)
        rest[used] = False
        assert bool((full[name][rest] == compact[name][-1]).all())
    h = torch.randn(3, full["lm_head.weight"].shape[1], generator=torch.Generator().manual_seed(0))
    lse_full = torch.logsumexp(h @ full["lm_head.weight"].float().T, -1)
    c = h @ compact["lm_head.weight"].float().T
    c[:, -1] += torch.log(torch.tensor(float(V - len(used))))
    assert torch.allclose(lse_full, torch.logsumexp(c, -1), atol=1e-4)


def _request(name: str, seed: int) -> tuple[dd.Harness, dict, list]:
    h = dd.HARNESSES[name]
    body, tasks = dd.conversation(h, random.Random(seed), corpus=dd.corpus_lines(),
                                  version=DATA_VERSION)
    return h, body, tasks


def test_engine_matches_transformers(model, tok, demo_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from freetoken.cache.tensors import Caches, KVPool, StateTensors
    from freetoken.types.forward_batch import ForwardBatch

    h, body, _ = _request("mini_tool", HELD_OUT_SEED)
    ti = dd.template_input(h, body)
    ids = tok.apply(ti.messages, ti.tools).input_ids
    ref = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # [T, V]
    cfg = model.cfg
    c = Caches(KVPool(cfg, len(ids) + 8, torch.float32, "cpu"),
               StateTensors(cfg, 1, torch.float32, "cpu"))
    got = model(ForwardBatch.single(ids, 0, torch.arange(len(ids)), 0, all_logits=True), c)
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _greedy(model, tok, ti, messages) -> tuple[list[int], str]:
    """Greedy tokens of the request as the server renders it (compacted when the checkpoint's
    manifest declares a compaction: `ServerState.render`)."""
    messages, tools = compacted(tok, messages, ti.tools)
    ids = tok.apply(messages, tools).input_ids
    r = generate(model, ids, SamplingParams(max_tokens=MAX_TURN, temperature=0.0),
                 eos_ids=tok.eos_token_ids)
    return r.token_ids, tok.decode(r.token_ids)


def _call(text: str) -> tuple[str, dict] | None:
    if "<tool_call>" not in text:
        return None
    body = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    parsed = parse_tool_call(body)
    assert parsed is not None, text
    return parsed[0], json.loads(parsed[1])


def _gap(reason: str):
    return pytest.mark.xfail(strict=True, reason=f"issue 27 open, the 3,385-step CPU-trained "
                             f"model (data v6, loss 0.14): {reason}")


@pytest.mark.parametrize("name", ["mini_tool", "opencode", "claude_code"])
def test_held_out_requests_end_with_a_valid_call_then_an_answer(model, tok, name) -> None:
    """Bug this catches: a demo that never ends its turn (the random one runs to the cap) or
    calls a tool the request does not offer / with arguments its schema refuses (the 181-step
    v2 model named Codex's exec_command on Claude Code's prompt, which offers Bash)."""
    im_end = tok.special_ids["<|im_end|>"]
    for seed in (HELD_OUT_SEED, HELD_OUT_SEED + 1):
        h, body, tasks = _request(name, seed)
        task = next(t for t in tasks if t.kind != "chat") if name != "claude_code" else tasks[0]
        ti = dd.template_input(h, body)
        first = next(i for i, m in enumerate(ti.messages) if m["role"] == "assistant")
        ids, text = _greedy(model, tok, ti, ti.messages[:first])
        assert ids[-1] == im_end and len(ids) < MAX_TURN, text
        if task.kind == "chat":
            assert _call(text) is None
            continue
        call = _call(text)
        assert call is not None, text
        assert dd.tool_call_errors(ti.tools, *call) == [], (call, text)
        # the harness runs the tool; the model answers after the result and ends again
        result = {"role": "tool", "content": h.result(task, "/home/dev/project")}
        msgs = [*ti.messages[:first],
                {"role": "assistant", "content": text.split("<tool_call>")[0].strip(),
                 "tool_calls": [{"type": "function", "function": {
                     "name": call[0], "arguments": call[1]}}]}, result]
        ids2, text2 = _greedy(model, tok, ti, msgs)
        assert ids2[-1] == im_end and len(ids2) < MAX_TURN, text2
        if name == "mini_tool":
            assert _call(text2) == ("bash", {"command": dd.MINI_DONE}), text2
        else:
            assert _call(text2) is None and text2.strip(), text2


# the arguments that say what a call does (the others, e.g. a description, only describe it)
_KEY_ARGS = ("command", "cmd", "file_path", "filePath", "path")


# OpenCode takes absolute paths: the model must join the working directory and the task's name,
# and the v6 CPU model still writes another directory or file (/tmp/tmpl4q1_gec/README.md for
# utils.py); OpenClaw answers a read with `ls`. Claude Code reads with `cat` in Bash from v6
# (relative to its shell), which the model follows (v5 read made-up absolute paths)
_UNCONDITIONED = _gap("its first call names the wrong file or tool (not the task's)")
_FOLLOWS = ("claude_code", "codex", "mini_text", "mini_tool")


@pytest.mark.parametrize("name", [n if n in _FOLLOWS else pytest.param(n, marks=_UNCONDITIONED)
                                  for n in sorted(dd.HARNESSES)])
def test_first_command_follows_the_task(model, tok, name) -> None:
    """Bug this catches: a first call that ignores the task (the v2 and v3 models run the same
    command for "what does README say" as for "list the files"): on a held-out list task and a
    held-out read task, each harness's first call is the tool and the command / path the task
    asks for (what the generator's gold call holds). One of each kind, so a model that always
    makes the same call cannot pass."""
    h = dd.HARNESSES[name]
    seen: set[str] = set()
    for seed in range(HELD_OUT_SEED, HELD_OUT_SEED + 60):
        body, tasks = dd.conversation(h, random.Random(seed), corpus=dd.corpus_lines(),
                                      version=DATA_VERSION)
        if tasks[0].kind not in {"list", "read"} - seen:
            continue
        ti = dd.template_input(h, body)
        first = next(i for i, m in enumerate(ti.messages) if m["role"] == "assistant")
        _, text = _greedy(model, tok, ti, ti.messages[:first])
        if name == "mini_text":
            got = text.split("```mswea_bash_command\n", 1)[-1].split("\n```")[0]
            assert got == tasks[0].command, (tasks[0].request, text)
        else:
            gold = ti.messages[first]["tool_calls"][0]["function"]
            call = _call(text)
            assert call is not None and call[0] == gold["name"], (tasks[0].request, text)
            for key in set(_KEY_ARGS) & set(gold["arguments"]):
                assert call[1].get(key) == gold["arguments"][key], (tasks[0].request, text)
        seen.add(tasks[0].kind)
        if len(seen) == 2:
            break
    assert seen == {"list", "read"}
