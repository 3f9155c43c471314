"""The demo model's prompt compactions (`freetoken.chat.compaction`: demo-v1, the shipped v5
weights'; demo-v2, data v6's): what they keep (the task, the working directory, every tool's name
or every core tool's, a schema that accepts and refuses the same calls), what they drop, their
prefix stability on recorded multi-turn harness traces (the radix cache's reuse per turn), and
the manifest gate (a checkpoint that declares none is untouched)."""
from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path

import pytest

from freetoken.chat import ChatTokenizer, anthropic_to_template, openai_to_template
from freetoken.chat import compaction as cp
from freetoken.models import demo_data as dd

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"
CWD = "/home/zoe/src/quartz-lemon"
TASK = "read docs/notes.txt"
_STATES_CWD = {"claude_code", "opencode", "openclaw", "codex"}  # (mini states none)


def _first(name: str) -> tuple[dd.Harness, object]:
    h = dd.HARNESSES[name]
    return h, dd.template_input(h, dd.base_request(h, TASK, CWD))


VERSIONS = pytest.mark.parametrize("version", sorted(cp.COMPACTIONS))


@VERSIONS
@pytest.mark.parametrize("name", sorted(dd.HARNESSES))
def test_keeps_the_task_cwd_and_tool_names_drops_the_instructions(name: str, version: str,
                                                                   tok) -> None:
    _h, ti = _first(name)
    msgs, tools = cp.COMPACTIONS[version](ti.messages, ti.tools)
    full = tok.apply(ti.messages, ti.tools).input_ids
    p = tok.apply(msgs, tools)
    assert TASK in p.text
    if name in _STATES_CWD:  # in the user message, beside the task (Codex: the one before)
        user = p.text.rsplit("<|im_start|>user\n", 2)
        assert f"Working directory: {CWD}" in "".join(user[-2:] if name == "codex" else user[-1:])
    for t in ti.tools or []:
        kept = version == cp.VERSION or t["function"]["name"] in cp.CORE_TOOLS
        assert (f'"name": "{t["function"]["name"]}"' in p.text) == kept
    # Claude Code's reminders and instructions, OpenCode's and Codex's long system prompts
    for gone in ("<system-reminder>", "Available agent types", "IMPORTANT: Assist with",
                 "You are a coding agent running in the Codex CLI", "## Recommended Workflow"):
        assert gone not in p.text
    assert len(p.input_ids) < len(full) / 3, (len(full), len(p.input_ids))
    if name == "claude_code":
        assert len(p.input_ids) < 3000 and len(full) > 18000


@pytest.mark.parametrize("version", dd.DATA_VERSIONS)
def test_schemas_accept_and_refuse_the_same_calls(version: int) -> None:
    """The slimmed schemas (of the data version's compaction) judge calls as the harnesses'
    own do (`tool_call_errors` on both): the generator's valid calls of every harness, and
    broken variants of them."""
    rng = random.Random(4)
    corpus = dd.corpus_lines()
    compact = cp.COMPACTIONS[dd.COMPACTION_OF[version]]
    for name, h in dd.HARNESSES.items():
        if name == "mini_text":
            continue
        for _ in range(10):
            body, _tasks = dd.conversation(h, rng, corpus=corpus, version=version)
            ti = dd.template_input(h, body)
            _, slim = compact(ti.messages, ti.tools)
            calls = [(c["function"]["name"], c["function"]["arguments"]) for m in ti.messages
                     if m["role"] == "assistant" for c in m.get("tool_calls") or []]
            for fn, args in calls:
                args = json.loads(args) if isinstance(args, str) else args
                variants = [args, {}, {**args, "no_such_arg": 1},
                            {k: 7 for k in args}, {k: None for k in args}]
                for a in variants:
                    assert (dd.tool_call_errors(slim, fn, a) == []) == (
                        dd.tool_call_errors(ti.tools, fn, a) == []), (name, fn, a)
    _, ti = _first("claude_code")
    _, slim = cp.compact(ti.messages, ti.tools)
    bash = next(t["function"] for t in slim if t["function"]["name"] == "Bash")
    assert "description" in bash["parameters"]["properties"]  # a parameter so named stays
    assert "description" not in bash and "description" not in json.dumps(
        bash["parameters"]["properties"]["command"])


def test_tool_results_are_cut_and_inputs_left_alone() -> None:
    long = "\n".join(f"line {i}" for i in range(500))
    msgs = [{"role": "system", "content": "x" * 5000 + "\nPlatform: linux\n"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "c", "content": long},
            {"role": "tool", "tool_call_id": "c", "content": "short"},
            {"role": "tool", "tool_call_id": "c",
             "content": "1\tok\n<system-reminder>\nIs it malware?\n</system-reminder>\n"}]
    before = copy.deepcopy(msgs)
    out, _ = cp.compact(msgs, None)
    assert msgs == before
    assert out[0] == {"role": "user", "content": "Platform: linux\n\nhi"}  # env beside the task
    assert out[1] == msgs[2]
    lines = out[2]["content"].split("\n")
    assert lines[:cp.RESULT_LINES] == long.split("\n")[:cp.RESULT_LINES]
    assert lines[-1] == cp.TRUNCATED and len(lines) == cp.RESULT_LINES + 1
    assert out[3]["content"] == "short"
    assert out[4]["content"] == "1\tok\n\n"
    assert cp.compact(msgs, None) == (out, None)


def _trace(path: str) -> list[dict]:
    with open(TRACES / path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@VERSIONS
@pytest.mark.parametrize("path,api", [
    ("claude_code/cc_try1.jsonl", "anthropic"), ("claude_code/cc_compact.jsonl", "anthropic"),
    ("opencode/oc_try1.jsonl", "openai"), ("openclaw/ocl_try1.jsonl", "openai"),
    ("mini_swe_agent/mini_tool.jsonl", "openai"), ("mini_swe_agent/mini_text.jsonl", "openai")])
def test_prefix_stable_on_recorded_multi_turn_traces(path: str, api: str, version: str,
                                                     tok) -> None:
    """Each request that continues an earlier one (its messages start with the earlier's, or
    with all but the earlier's last user message, which OpenClaw replaces every turn: the same
    agent thread, the next turn) must render, compacted, to tokens that start with >= 95% of the
    earlier compacted prompt: what a radix cache holding that prompt reuses. Where the messages
    continue whole, the full prompts are the oracle that the pair is a continuation (they reuse
    >= 95% as sent)."""
    to_ti = anthropic_to_template if api == "anthropic" else openai_to_template
    seen: list[tuple[list, list[int], list[int]]] = []  # (messages, full ids, compacted ids)
    pairs = 0
    for rec in _trace(path):
        body = rec["body"]
        ti = to_ti(body)
        full = tok.apply(ti.messages, ti.tools, ti.enable_thinking).input_ids
        m, t = cp.COMPACTIONS[version](ti.messages, ti.tools)
        ids = tok.apply(m, t, ti.enable_thinking).input_ids
        for prev_msgs, prev_full, prev_ids in seen:
            whole = ti.messages[:len(prev_msgs)] == prev_msgs
            replaced = (len(prev_msgs) > 2 and prev_msgs[-1]["role"] == "user"
                        and ti.messages[:len(prev_msgs) - 1] == prev_msgs[:-1])
            if len(prev_msgs) < len(ti.messages) and (whole or replaced):
                if whole:
                    assert _lcp(prev_full, full) >= 0.95 * len(prev_full)  # the oracle's pair
                reuse = _lcp(prev_ids, ids) / len(prev_ids)
                assert reuse >= 0.95, (path, rec["seq"], reuse)
                pairs += 1
        seen.append((ti.messages, full, ids))
        assert len(ids) <= len(full)
    assert pairs >= 3


def test_the_manifest_gate(tmp_path: Path, qwen_dir: Path) -> None:
    """Only a checkpoint whose `demo_manifest.json` names a compaction gets it: not a plain
    checkpoint, not the v4 demo's manifest (no `prompt_compaction`); an unknown version is an
    error rather than a model served prompts it was not trained on."""
    assert cp.compaction_for_dir(tmp_path) is None
    assert ChatTokenizer.from_dir(qwen_dir).compaction is None
    d = tmp_path / "ckpt"
    shutil.copytree(qwen_dir, d)
    (d / "demo_manifest.json").write_text(json.dumps({"sha256": "x", "train": {}}))
    assert ChatTokenizer.from_dir(d).compaction is None
    (d / "demo_manifest.json").write_text(json.dumps({"prompt_compaction": cp.VERSION}))
    assert ChatTokenizer.from_dir(d).compaction == (cp.VERSION, cp.compact)
    (d / "demo_manifest.json").write_text(json.dumps({"prompt_compaction": cp.VERSION_V2}))
    assert ChatTokenizer.from_dir(d).compaction == (cp.VERSION_V2, cp.compact_v2)
    (d / "demo_manifest.json").write_text(json.dumps({"prompt_compaction": "demo-v0"}))
    with pytest.raises(ValueError, match="demo-v0"):
        ChatTokenizer.from_dir(d)


def _called(h: dd.Harness, n: int) -> tuple[set[str], list]:
    """(the tools `n` v6 conversations of `h` call, their last template input)."""
    rng = random.Random(9)
    names: set[str] = set()
    for _ in range(n):
        body, _ = dd.conversation(h, rng, corpus=dd.corpus_lines(), version=6)
        ti = dd.template_input(h, body)
        names |= {c["function"]["name"] for m in ti.messages if m["role"] == "assistant"
                  for c in m.get("tool_calls") or []}
    return names, ti


@pytest.mark.parametrize("name", sorted(dd.HARNESSES))
def test_demo_v2_keeps_every_tool_the_data_calls_and_no_other(name: str) -> None:
    """Bug this catches: a core list that misses a tool some harness's data calls (the model
    would be trained to call a tool its prompt no longer shows), or keeps tools never called
    (Claude Code's 21 others are ~1.9k tokens a prompt)."""
    h = dd.HARNESSES[name]
    called, ti = _called(h, 40)
    _, tools = cp.compact_v2(ti.messages, ti.tools)
    kept = {t["function"]["name"] for t in tools or []}
    assert kept == called, (sorted(kept), sorted(called))
    assert called <= cp.CORE_TOOLS
    assert [t for t in cp.compact_tools(ti.tools) or []
            if t["function"]["name"] in kept] == (tools or [])  # slimmed as demo-v1, in order
    if name != "mini_text":
        assert len(tools) < len(ti.tools) or name == "mini_tool"


def test_demo_v2_is_demo_v1_on_messages_and_on_tools_without_core_ones() -> None:
    _h, ti = _first("openclaw")
    before = copy.deepcopy((ti.messages, ti.tools))
    v1, v2 = cp.compact(ti.messages, ti.tools), cp.compact_v2(ti.messages, ti.tools)
    assert (ti.messages, ti.tools) == before  # inputs untouched
    assert v2[0] == v1[0] and v2 == cp.compact_v2(ti.messages, ti.tools)  # deterministic
    other = [t for t in ti.tools if t["function"]["name"] not in cp.CORE_TOOLS]
    assert other and cp.compact_v2(ti.messages, other)[1] == cp.compact_tools(other)
    assert cp.compact_v2(ti.messages, None)[1] is None


# Claude Code's first request, recorded (cc_try1 seq 1) and as data v6 starts it: Qwen3 tokens
# measured 18,868 / 18,838 as sent, 2,382 / 2,352 through demo-v1, 298 / 268 through demo-v2
CC_V1_MIN, CC_V2_MAX = 2000, 340


def test_claude_codes_first_request_through_demo_v2(tok) -> None:
    h = dd.HARNESSES["claude_code"]
    bodies = [dd.recorded_body(h), dd.base_request(h, "list the files", "/tmp/tmpa8x_k2q1")]
    for body in bodies:
        ti = anthropic_to_template(body)
        n = {v: len(tok.apply(*cp.COMPACTIONS[v](ti.messages, ti.tools),
                              ti.enable_thinking).input_ids) for v in cp.COMPACTIONS}
        assert n[cp.VERSION] > CC_V1_MIN and n[cp.VERSION_V2] < CC_V2_MAX, n
