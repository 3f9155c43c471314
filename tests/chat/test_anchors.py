"""Anchors on token ids, checked against an oracle that finds the tags in the text and maps
character offsets to token indices."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from freetoken.chat import ChatTokenizer, anthropic_to_template, detect_anchors, openai_to_template
from freetoken.types.api import Anchor

_TAGS = {"<think>": "think_start", "</think>": "think_end", "<tool_call>": "tool_call_start",
         "<tool_response>": "tool_result_start", "</tool_response>": "tool_result_end"}
_PATTERN = re.compile(r"<\|im_start\|>(\w*)|" + "|".join(re.escape(t) for t in _TAGS))


def oracle(text: str, raw: Tokenizer) -> list[tuple[int, str, str | None]]:
    enc = raw.encode(text, add_special_tokens=False)
    tok_at = {start: i for i, (start, _end) in enumerate(enc.offsets)}
    out: list[tuple[int, str, str | None]] = []
    role = None
    turns = 0
    first_role = None
    for m in _PATTERN.finditer(text):
        pos = tok_at[m.start()]
        if m.group(0).startswith("<|im_start|>"):
            role = m.group(1)
            turns += 1
            if turns == 1:
                first_role = role
            elif turns == 2 and first_role == "system":
                out.append((pos, "head_end", None))
            out.append((pos, "turn_start", role))
        elif role != "system":
            out.append((pos, _TAGS[m.group(0)], None))
    return out


def _tuples(anchors: list[Anchor]) -> list[tuple[int, str, str | None]]:
    return [(a.position, a.kind, a.role) for a in anchors]


def test_trace_anchors_match_oracle(tok: ChatTokenizer, qwen_dir: Path, trace_reqs: list) -> None:
    raw = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    kinds: set[str] = set()
    for name, rec in trace_reqs[::3]:
        body = rec["body"]
        ti = (anthropic_to_template(body) if rec["path"].startswith("/v1/messages")
              else openai_to_template(body))
        p = tok.apply(ti.messages, ti.tools, ti.enable_thinking)
        tags = [a for a in p.anchors if a.kind != "tool_def"]
        assert _tuples(tags) == oracle(p.text, raw), name
        kinds |= {a.kind for a in tags}
        defs = [a for a in p.anchors if a.kind == "tool_def"]
        assert [a.role for a in defs] == [(t.get("function") or t)["name"] for t in ti.tools or []]
        lines, at = {}, p.text.find("<tools>\n")  # oracle: each JSON line of the block
        if at >= 0:
            at += len("<tools>")
            for line in p.text[at + 1: p.text.index("\n</tools>")].split("\n"):
                fn = json.loads(line)
                lines[(fn.get("function") or fn)["name"]] = at  # offset of its newline
                at += len(line) + 1
        assert {a.role for a in defs} == set(lines), name
        for a in defs:  # the tokens before it spell the text before the line, newline aside
            head = tok.decode(p.input_ids[: a.position])
            assert p.text[: lines[a.role]].startswith(head), name
            assert len(tok.decode(p.input_ids[: a.position + 2])) > lines[a.role], name
        for a in tags:  # the tag token sits exactly at the anchor
            tag = tok.decode([p.input_ids[a.position]])
            assert tag == ("<|im_start|>" if a.kind in ("turn_start", "head_end") else
                           next(t for t, k in _TAGS.items() if k == a.kind))
    assert kinds == {"head_end", "turn_start", "think_start", "think_end", "tool_call_start",
                     "tool_result_start", "tool_result_end"}


def test_no_head_end_without_leading_system(tok: ChatTokenizer) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"},
                                  {"role": "system", "content": "late <tool_call> mention"},
                                  {"role": "user", "content": "c"}]
    p = tok.apply(msgs)
    got = _tuples(p.anchors)
    assert [k for _, k, _ in got] == ["turn_start"] * 5
    assert [r for _, _, r in got] == ["user", "assistant", "system", "user", "assistant"]
    assert got[0][0] == 0


def test_head_end_position(tok: ChatTokenizer) -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    ids = tok.apply(msgs).input_ids
    head = tok.encode("<|im_start|>system\nS<|im_end|>\n")
    anchors = detect_anchors(ids, tok.anchor_tokens)
    assert anchors[1] == Anchor(len(head), "head_end")
    assert anchors[2] == Anchor(len(head), "turn_start", role="user")
