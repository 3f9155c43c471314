"""The normalisation pipeline step by step: each fires on what it targets, leaves everything
else alone, is switchable, and reports what it changed."""
from __future__ import annotations

import pytest

from harness_adapters.normalise import STEPS, parse_step_switches, run_pipeline

ALL = {s: True for s in STEPS}


def _anth() -> dict:
    return {"model": "m", "max_tokens": 10, "metadata": {"user_id": "u"},
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.a;"},
                       {"type": "text", "text": "You are claude-opus-4-8[1m].",
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "Bash", "description": "runs on claude-opus-4-8[1m]",
                       "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "system", "content": "reminder"},
                         {"role": "assistant", "content": [
                             {"type": "tool_use", "name": "Bash", "input": {"c": 1}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "t1", "content": [
                                 {"type": "text", "text": "out"}],
                              "cache_control": {"type": "ephemeral"}}]}]}


def test_each_step_fires_on_its_target_and_reports_counts() -> None:
    body, fired = run_pipeline(_anth(), "anthropic", ALL)
    assert fired == {"strip_billing_header": 1, "drop_cache_control": 2, "drop_metadata": 1,
                     "canonical_content": 2, "stable_tool_ids": 1, "unify_model_suffix": 2}
    assert [b["text"] for b in body["system"]] == ["You are claude-opus-4-8."]
    assert body["messages"][0]["content"] == "hi"
    assert body["messages"][3]["content"][0]["content"] == "out"
    assert body["tools"][0]["description"] == "runs on claude-opus-4-8"
    assert body["messages"][1] == {"role": "system", "content": "reminder"}  # kept in place


def test_input_is_never_mutated() -> None:
    src = _anth()
    run_pipeline(src, "anthropic", ALL, fold_system=True)
    assert src == _anth()


def test_switches_off_leave_the_body_alone() -> None:
    body, fired = run_pipeline(_anth(), "anthropic", {s: False for s in STEPS})
    assert fired == {} and body == _anth()


def test_tool_ids_are_deterministic_across_requests() -> None:
    """Regression: an id minted per request would differ on every re-send of the history."""
    a, _ = run_pipeline(_anth(), "anthropic", {"stable_tool_ids": True})
    b, _ = run_pipeline(_anth(), "anthropic", {"stable_tool_ids": True})
    ida = a["messages"][2]["content"][0]["id"]
    assert ida == b["messages"][2]["content"][0]["id"] and ida.startswith("toolu_")
    oa = {"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "keep", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}]}
    out, fired = run_pipeline(oa, "openai", {"stable_tool_ids": True})
    calls = out["messages"][0]["tool_calls"]
    assert fired == {"stable_tool_ids": 1} and calls[1]["id"] == "keep"
    assert calls[0]["id"].startswith("call_")


def test_mid_conversation_system_folds_in_place_only_when_asked() -> None:
    """Hoisting reminders to the top loses the cache every turn: they stay where they are, and
    become a user turn at the same place when the template forbids system messages there."""
    oa = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                       {"role": "system", "content": "R"}, {"role": "user", "content": "v"}]}
    kept, fired = run_pipeline(oa, "openai", {"system_in_place": True})
    assert kept == oa and not fired
    folded, fired = run_pipeline(oa, "openai", {"system_in_place": True}, fold_system=True)
    assert [m["role"] for m in folded["messages"]] == ["system", "user", "user", "user"]
    assert folded["messages"][2]["content"] == "R" and fired == {"system_in_place": 1}


def test_canonical_content_keeps_multi_part_and_annotated_content() -> None:
    oa = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]},
                       {"role": "user", "content": [{"type": "text", "text": "c",
                                                     "cache_control": {}}]}]}
    out, fired = run_pipeline(oa, "openai", {"canonical_content": True})
    assert out == oa and not fired


def test_step_switch_parsing() -> None:
    assert parse_step_switches(["drop_metadata=off", "unify_model_suffix=on"]) == {
        "drop_metadata": False, "unify_model_suffix": True}
    with pytest.raises(ValueError, match="NAME=on"):
        parse_step_switches(["nope=on"])
    with pytest.raises(ValueError, match="unknown normalisation steps"):
        run_pipeline({}, "openai", {"nope": True})


def test_only_meaning_changing_step_is_marked() -> None:
    assert [s.name for s in STEPS.values() if s.changes_prompt] == ["unify_model_suffix"]


def test_fold_is_decided_by_the_template() -> None:
    """`--fold-system auto`: fold only when the chat template refuses a system message after
    the first turn (Qwen3's renders it in place)."""
    from freetoken.chat import ChatInputError, ChatTokenizer, qwen3_tokenizer_dir
    from freetoken.proxy.app import template_rejects_mid_system

    assert template_rejects_mid_system(ChatTokenizer.from_dir(qwen3_tokenizer_dir())) is False

    class Strict:
        def render(self, messages):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ChatInputError("System message must be at the beginning.", "messages")
            return ""

    assert template_rejects_mid_system(Strict()) is True
