"""The demo model's training-data generator: seeded, its tool calls valid for the request's own
tools, its prompts token for token what the engine renders for those harnesses, for every data
version it makes (v5: the shipped weights' data, unchanged; v6: the training default)."""
from __future__ import annotations

import hashlib
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


VERSIONS = pytest.mark.parametrize("version", dd.DATA_VERSIONS)


@VERSIONS
@pytest.mark.parametrize("name", sorted(dd.HARNESSES))
def test_every_call_names_a_request_tool_with_valid_arguments(name: str, version: int,
                                                              corpus) -> None:
    h = dd.HARNESSES[name]
    rng = random.Random(11)
    kinds = set()
    for _ in range(40):
        body, tasks = dd.conversation(h, rng, corpus=corpus, version=version)
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


@VERSIONS
@pytest.mark.parametrize("name", sorted(dd.HARNESSES))
def test_fast_encoder_is_tok_apply(name: str, version: int, tok, corpus) -> None:
    """The generator's piecewise encoding gives exactly `ChatTokenizer.apply`'s ids (what the
    engine feeds the model), with and without the thinking switch."""
    h = dd.HARNESSES[name]
    body, _ = dd.conversation(h, random.Random(3), corpus=corpus, version=version)
    enc = dd._Encoder(tok)
    for ti in (dd.template_input(h, body), dd.compacted_input(h, body, version)):
        for think in (None, False):
            want = tok.apply(ti.messages, ti.tools, think, add_generation_prompt=True).input_ids
            assert enc.ids(ti.messages, ti.tools, think)[0] == want


@VERSIONS
def test_samples_are_seeded_and_train_only_assistant_turns(tok, version: int) -> None:
    counts = {"mini_tool": 3, "mini_text": 3, "opencode": 2}
    a = dd.generate(counts, 5, tok, version=version)
    b = dd.generate(counts, 5, tok, version=version)
    assert [(s.ids, s.mask) for s in a] == [(s.ids, s.mask) for s in b]
    assert [s.ids for s in dd.generate(counts, 6, tok, version=version)] != [s.ids for s in a]
    # worker processes make the same samples (each shard has its own seeded rng); bug this
    # catches: a shared rng whose draws depend on which process ran which shard
    par = dd.generate(counts, 5, tok, jobs=2, tok_dir=tokenizer_source_dir(), version=version)
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
    for counts in dd.COUNTS.values():  # every harness has a count
        assert set(counts) == set(dd.HARNESSES) and min(counts.values()) > 0
    assert dd.DEFAULT_COUNTS == dd.COUNTS[dd.DATA_VERSION]
    assert dd.PROMPT_COMPACTION == dd.COMPACTION_OF[dd.DATA_VERSION] == "demo-v2"


@VERSIONS
@pytest.mark.parametrize("name", ["claude_code", "openclaw", "mini_text"])
def test_samples_are_what_the_server_renders_the_compacting_model(name: str, version: int, tok,
                                                                   corpus, tmp_path) -> None:
    """Each version's one cut (v5: demo-v1, v6: demo-v2): a sample's prompt is token for token
    what `ServerState.render` feeds a checkpoint that declares that version's compaction
    (`demo_manifest.json`), for the same request; and it is several times shorter than the
    request rendered whole. Bug this catches: the generator and the server cutting differently
    (a model trained on prompts it is never served)."""
    import shutil

    from freetoken.chat import compaction, qwen3_tokenizer_dir
    from freetoken.server.state import compacted

    d = tmp_path / "ckpt"
    shutil.copytree(qwen3_tokenizer_dir(), d)
    cut = dd.COMPACTION_OF[version]
    (d / "demo_manifest.json").write_text(json.dumps({"prompt_compaction": cut}))
    served = ChatTokenizer.from_dir(d)
    assert served.compaction == (cut, compaction.COMPACTIONS[cut])
    h = dd.HARNESSES[name]
    body, _ = dd.conversation(h, random.Random(8), corpus=corpus, version=version)
    s = dd.render_sample(h, body, dd._Encoder(tok), think_off=False, version=version)
    ti = dd.template_input(h, body)
    last = max(i for i, m in enumerate(ti.messages) if m["role"] == "assistant")
    msgs, tools = compacted(served, ti.messages[:last], ti.tools)
    want = served.apply(msgs, tools, ti.enable_thinking).input_ids
    assert s.ids[:len(want)] == want and s.mask[len(want) - 1] == 0 and s.mask[len(want)] == 1
    whole = tok.apply(ti.messages[:last], ti.tools, ti.enable_thinking).input_ids
    assert len(want) < len(whole) / 2


# sha256 of json.dumps([(harness, ids, mask)]) of `generate({every harness: 2}, 0, tok,
# version=5)`, and of json.dumps(bodies, sort_keys=True) of each harness's (sorted)
# `conversation(h, Random(12345), version=5)`: computed with the v5 generator before v6 existed
V5_SAMPLES = "62f47b093ab92a32307e7a4aa0cfbc0cdce3e7507d881279c9746fd651045a6f"
V5_BODIES = "1ad3836d39a5bb8bfbf15d384f598f68e385620faa0950d4acad123364455f3a"


def test_v5_is_still_what_it_was(tok, corpus) -> None:
    """The shipped weights' data version is made exactly as before v6 (their held-out requests
    are built with it); v6 differs."""
    def digest(version: int) -> tuple[str, str, int]:
        s = dd.generate({n: 2 for n in dd.HARNESSES}, 0, tok, version=version)
        bodies = [dd.conversation(dd.HARNESSES[n], random.Random(12345), corpus=corpus,
                                  version=version)[0] for n in sorted(dd.HARNESSES)]
        return (hashlib.sha256(json.dumps([(x.harness, x.ids, x.mask) for x in s]).encode())
                .hexdigest(), hashlib.sha256(json.dumps(bodies, sort_keys=True).encode())
                .hexdigest(), sum(len(x.ids) for x in s))
    assert digest(5) == (V5_SAMPLES, V5_BODIES, 15053)
    v6 = digest(6)
    assert v6[0] != V5_SAMPLES and v6[1] != V5_BODIES
    with pytest.raises(ValueError, match="data version 4"):
        dd.conversation(dd.HARNESSES["codex"], random.Random(0), version=4)
