"""Head breaks: the adapters' character offsets (`HarnessAdapter.head_breaks`) and their token
positions (`freetoken.proxy.heads.HeadBreaks`), against the real Qwen3 tokenizer and template.

The property the engine relies on: two prompts whose system text agrees up to a break share
their tokens up to the break's position, whatever follows (else the snapshot there serves no
other session), and the position lies within a couple of tokens of the break."""
from __future__ import annotations

import json
import random

import pytest
from trace_replay import TRACES, records, tokenizer

from freetoken.proxy.heads import HeadBreaks
from freetoken.proxy.sessions import first_divergence
from harness_adapters import BY_NAME
from harness_adapters.base import system_text


def test_breaks_are_block_boundaries_and_mark_lines() -> None:
    body = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                       {"type": "text", "text": "Intro."},
                       {"type": "text", "text": "Rules.\n\n# Environment\n cwd: /a\n"}],
            "messages": []}
    text = system_text(body)
    assert text == "Intro.\nRules.\n\n# Environment\n cwd: /a\n"
    cc = BY_NAME["claude_code"].head_breaks(body)
    # the text before the second block, and before the "# Environment" line (whitespace off)
    assert [text[:c] for c in cc] == ["Intro.", "Intro.\nRules."]
    assert BY_NAME["generic"].head_breaks(body) == [len("Intro.")]  # blocks only, no marks
    oa = {"messages": [{"role": "system", "content": "You are X.\n<env>\n cwd: /a\n</env>"}]}
    assert BY_NAME["opencode"].head_breaks(oa) == [len("You are X.")]
    assert BY_NAME["opencode"].head_breaks({"messages": [{"role": "user", "content": "hi"}]}) == []


def test_openclaw_breaks_on_the_recorded_system_prompt() -> None:
    """OpenClaw's deferred tool list (an announce turn drops a tool from it), its working
    directory (`## Workspace`) and its per-session block (date, time:
    `<!-- openclaw:attempt:DYNAMIC -->`), over both of its APIs."""
    for name in ("ocl_anth", "ocl_try1"):
        body = records(TRACES / "openclaw" / f"{name}.jsonl")[0]["body"]
        text = system_text(body)
        cuts = BY_NAME["openclaw"].head_breaks(body)
        after = [text[c:].lstrip()[:40] for c in cuts]
        assert after[0].startswith("- agents_list (core):")
        assert after[1].startswith("## Workspace\nWorking directory:")
        assert after[-1].startswith("<!-- openclaw:attempt:DYNAMIC -->")


def _prompt(system: str) -> list[int]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    return tokenizer().apply(msgs, tools=[{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}}}]).input_ids


@pytest.mark.parametrize("window", [2048, 120])  # the whole head; only its last 120 chars
def test_positions_are_shared_by_every_continuation(window: int) -> None:
    rng = random.Random(7)
    words = ["alpha", "beta.", "gamma,", "(delta)", "x=1", "\n", "\n\n", " ", "  ", "#", "é",
             "日本", "`code`", "::", "-", "42", "\t"]
    heads = HeadBreaks(tokenizer(), min_tokens=4, window=window, min_start=4)
    checked = 0
    for _ in range(30):
        head = "".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
        c = len(head)
        tails = ["".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(3)]
        prompts = [_prompt(head + t) for t in tails]
        got = [heads.positions(head + t, [c], ids) for t, ids in zip(tails, prompts)]
        if not got[0]:
            continue  # a head too short to be worth a snapshot (fixed seed: a few)
        assert got[0] == got[1] == got[2], (head, tails, got)
        p = got[0][0]
        assert all(p <= first_divergence(prompts[0], other) for other in prompts[1:])
        # close to the break: at most the merged tokens on either side are left out
        if window > len(head):  # a short window may find its words earlier in the head
            assert p >= len(tokenizer().encode(head)), (head, p)  # +3 preamble, -3 left out
        checked += 1
    assert checked >= 20


def test_min_tokens_and_missing_text() -> None:
    heads = HeadBreaks(tokenizer(), min_tokens=256)
    system = "word " * 400 + "\n<env>\n"
    ids = _prompt(system)
    assert heads.positions(system, [10], ids) == []  # 10 characters: not worth a snapshot
    assert len(heads.positions(system, [len("word " * 400)], ids)) == 1
    assert heads.positions(system, [len("word " * 300), len("word " * 320)], ids) == [
        heads.positions(system, [len("word " * 300)], ids)[0]]  # too close to the one before
    assert heads.positions("other " * 400, [2000], ids) == []  # not in this prompt


def test_a_system_text_that_starts_with_a_newline() -> None:
    """Claude Code's main system block starts with "\\n": after the template's "system\\n" the
    two newlines are one token, so the text's own first token is not in the prompt."""
    heads = HeadBreaks(tokenizer(), window=1 << 20)  # the whole prefix, from the text's start
    system = "\n" + "".join(f"Rule {i}: be kind. " for i in range(300)) + (
        "\n# Environment\n cwd: /a\n")
    c = system.index("\n# Environment")
    ids = _prompt(system)
    [p] = heads.positions(system, [c], ids)
    d = first_divergence(ids, _prompt(system[:c] + "\n# Environment\n cwd: /b\n"))
    assert 0 < d - p <= 10, (p, d)  # "\n# Environment\n cwd: /" and the token left out


def _drop_line(body: dict, after: str) -> dict:
    """`body` with the line after the one holding `after` removed from its system text."""
    out = json.loads(json.dumps(body))
    sys_msg = out["messages"][0] if "messages" in out and out["messages"][0]["role"] == "system" \
        else None
    text = sys_msg["content"] if sys_msg is not None else out["system"]
    assert isinstance(text, str)
    i = text.index("\n", text.index(after)) + 1
    text = text[:i] + text[text.index("\n", i) + 1:]
    if sys_msg is not None:
        sys_msg["content"] = text
    else:
        out["system"] = text
    return out


def test_openclaw_announce_turn_dropped_tool_line_is_an_anchor() -> None:
    """#23: OpenClaw's announce turn drops a tool line ~540 characters (~130 tokens) into its
    system prompt. Bug caught: no break sat there, and HeadBreaks dropped every break under 256
    tokens, so the announce turn resumed from the zero state (the 131 shared tokens lost).
    On the recorded first request of both traces: the break's anchor sits at most a few tokens
    before the announce variant's first divergence."""
    tok = tokenizer()
    heads = HeadBreaks(tok)  # the proxy's defaults
    ad = BY_NAME["openclaw"]
    for name in ("ocl_try1", "ocl_anth"):
        rec = records(TRACES / "openclaw" / f"{name}.jsonl")[0]
        body = rec["body"]
        if isinstance(body.get("system"), list):  # Anthropic: one text block, as recorded
            body = {**body, "system": system_text(body)}
        announce = _drop_line(body, "Available deferred-schema tools:")
        ids, other = (_render(tok, b) for b in (body, announce))
        d = first_divergence(ids, other)
        got = heads.positions(system_text(body), ad.head_breaks(body), ids)
        before = [p for p in got if p <= d]
        assert before and 64 <= before[-1] < 256, (name, d, got)
        assert d - before[-1] <= 4, (name, d, got)
        assert before == heads.positions(system_text(announce), ad.head_breaks(announce), other)[
            :len(before)]  # the announce turn's own prompt has the same anchor


def _render(tok, body: dict) -> list[int]:
    from freetoken.chat.anthropic_map import anthropic_to_template
    from freetoken.chat.openai_map import openai_to_template

    ti = (anthropic_to_template if "system" in body else openai_to_template)(body)
    return tok.apply(ti.messages, tools=ti.tools, enable_thinking=ti.enable_thinking).input_ids
