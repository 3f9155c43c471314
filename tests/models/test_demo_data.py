"""The demo model's training-data generator: seeded, its tool calls valid for the request's own
tools, its prompts token for token what the engine renders for those harnesses."""
from __future__ import annotations

import json
import random
import re

import pytest

from freetoken.chat.tokenizer import ChatTokenizer
from freetoken.models import demo_data as dd
from freetoken.models.demo import tokenizer_source_dir


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(tokenizer_source_dir())


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return dd.corpus_lines()


def _calls(h: dd.Harness, body: dict) -> tuple[list, list[tuple[str, dict]]]:
    ti = dd.template_input(h, body)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for m in ti.messages
             if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    return ti.tools, calls


@pytest.mark.parametrize("name", sorted(dd.HARNESSES))
def test_every_call_names_a_request_tool_with_valid_arguments(name: str, corpus) -> None:
    h = dd.HARNESSES[name]
    rng = random.Random(11)
    kinds = set()
    for _ in range(40):
        body, tasks = dd.conversation(h, rng, corpus=corpus)
        kinds |= {t.kind for t in tasks}
        tools, calls = _calls(h, body)
        if name == "mini_text":  # text protocol: one bash block in every assistant message
            assert not calls and not tools
            for m in body["messages"]:
                if m["role"] == "assistant":
                    assert len(re.findall(r"```mswea_bash_command\n.*?\n```", m["content"],
                                          re.DOTALL)) == 1
            continue
        n_tool_tasks = sum(t.kind != "chat" for t in tasks)
        assert len(calls) == n_tool_tasks * (2 if name == "mini_tool" else 1)
        for fn, args in calls:
            assert dd.tool_call_errors(tools, fn, args) == [], (fn, args)
    assert kinds >= {"list", "read", "shell", "write"}


def test_schema_errors_catch_what_a_harness_would_refuse() -> None:
    """A generator bug that wrote a wrong argument must fail the test above: the checker
    itself is tested on Claude Code's real Read schema."""
    body = dd.recorded_body(dd.HARNESSES["claude_code"])
    read = next(t for t in body["tools"] if t["name"] == "Read")
    tools = [{"type": "function", "function": {"name": "Read",
                                               "parameters": read["input_schema"]}}]
    assert dd.tool_call_errors(tools, "Read", {"file_path": "/a/b"}) == []
    assert dd.tool_call_errors(tools, "Read", {})  # required
    assert dd.tool_call_errors(tools, "Read", {"file_path": 3})  # type
    assert dd.tool_call_errors(tools, "Read", {"file_path": "/a", "path": "/a"})  # additional
    assert dd.tool_call_errors(tools, "Read", {"file_path": "/a", "limit": True})  # bool≠int
    assert dd.tool_call_errors(tools, "Bash", {"command": "ls"})  # not in this tool list


@pytest.mark.parametrize("name", sorted(dd.HARNESSES))
def test_fast_encoder_is_tok_apply(name: str, tok, corpus) -> None:
    """The generator's piecewise encoding gives exactly `ChatTokenizer.apply`'s ids (what the
    engine feeds the model), with and without the thinking switch."""
    h = dd.HARNESSES[name]
    body, _ = dd.conversation(h, random.Random(3), corpus=corpus)
    ti = dd.template_input(h, body)
    enc = dd._Encoder(tok)
    for think in (None, False):
        want = tok.apply(ti.messages, ti.tools, think, add_generation_prompt=True).input_ids
        assert enc.ids(ti.messages, ti.tools, think)[0] == want


def test_samples_are_seeded_and_train_only_assistant_turns(tok) -> None:
    counts = {"mini_tool": 3, "mini_text": 3, "opencode": 2}
    a = dd.generate(counts, 5, tok)
    b = dd.generate(counts, 5, tok)
    assert [(s.ids, s.mask) for s in a] == [(s.ids, s.mask) for s in b]
    assert [s.ids for s in dd.generate(counts, 6, tok)] != [s.ids for s in a]
    # worker processes make the same samples (each shard has its own seeded rng); bug this
    # catches: a shared rng whose draws depend on which process ran which shard
    par = dd.generate(counts, 5, tok, jobs=2, tok_dir=tokenizer_source_dir())
    assert [(s.ids, s.mask) for s in par] == [(s.ids, s.mask) for s in a]
    im_start, im_end = tok.special_ids["<|im_start|>"], tok.special_ids["<|im_end|>"]
    for s in a:
        assert s.ids[-1] == im_end and s.mask[-1] == 1
        spans = "".join(map(str, s.mask)).split("0")
        spans = [x for x in spans if x]
        assert len(spans) >= 2  # a call and an answer
        text = tok.decode([t for t, m in zip(s.ids, s.mask) if m])
        assert "<|im_start|>" not in text and "<think>" not in text
        assert text.count("<|im_end|>") == len(spans)
        # the generation prompt itself is never a target
        last = max(i for i, t in enumerate(s.ids) if t == im_start)
        assert s.mask[last:last + 3] == [0, 0, 0]
    answers = [tok.decode(s.ids[-60:]) for s in a]
    assert any("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in x for x in answers)


def test_read_answers_quote_the_tool_result(corpus) -> None:
    h = dd.HARNESSES["opencode"]
    rng = random.Random(2)
    seen = 0
    for _ in range(30):
        body, _tasks = dd.conversation(h, rng, corpus=corpus)
        msgs = body["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "tool" and "<content>" in m["content"]:
                answer = msgs[i + 1]["content"]
                first = answer.split("\n\n", 1)[1].split("\n")[0]
                assert first in m["content"]
                seen += 1
    assert seen >= 3
    assert json.dumps(dd.DEFAULT_COUNTS)  # every harness has a count
    assert set(dd.DEFAULT_COUNTS) == set(dd.HARNESSES)


@pytest.mark.parametrize("name", ["claude_code", "openclaw", "mini_text"])
def test_samples_are_what_the_server_renders_the_compacting_model(name: str, tok, corpus,
                                                                   tmp_path) -> None:
    """Data v5's one cut: a sample's prompt is token for token what `ServerState.render` feeds a
    checkpoint that declares the compaction (`demo_manifest.json`), for the same request; and it
    is several times shorter than the request rendered whole. Bug this catches: the generator
    and the server cutting differently (a model trained on prompts it is never served)."""
    import shutil

    from freetoken.chat import compaction, qwen3_tokenizer_dir
    from freetoken.server.state import compacted

    d = tmp_path / "ckpt"
    shutil.copytree(qwen3_tokenizer_dir(), d)
    (d / "demo_manifest.json").write_text(json.dumps({"prompt_compaction": dd.PROMPT_COMPACTION}))
    served = ChatTokenizer.from_dir(d)
    assert served.compaction == (compaction.VERSION, compaction.compact)
    h = dd.HARNESSES[name]
    body, _ = dd.conversation(h, random.Random(8), corpus=corpus)
    s = dd.render_sample(h, body, dd._Encoder(tok), think_off=False)
    ti = dd.template_input(h, body)
    last = max(i for i, m in enumerate(ti.messages) if m["role"] == "assistant")
    msgs, tools = compacted(served, ti.messages[:last], ti.tools)
    want = served.apply(msgs, tools, ti.enable_thinking).input_ids
    assert s.ids[:len(want)] == want and s.mask[len(want) - 1] == 0 and s.mask[len(want)] == 1
    whole = tok.apply(ti.messages[:last], ti.tools, ti.enable_thinking).input_ids
    assert len(want) < len(whole) / 2
