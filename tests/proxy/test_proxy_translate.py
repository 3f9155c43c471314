"""Request and whole-response translation: a conversation sent through the other API and back
comes out as it went in (text, reasoning, tool calls with their ids, tool results, system
messages in place), and usage/stop reasons map by each API's convention."""
from __future__ import annotations

import json

import pytest

from freetoken.proxy.translate import (
    TranslationError,
    anthropic_to_openai_request,
    anthropic_to_openai_response,
    openai_to_anthropic_request,
    openai_to_anthropic_response,
)

OA = {"model": "m", "max_tokens": 77, "stream": True, "temperature": 0.5, "stop": ["X"],
      "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "read", "description": "d",
                                                  "parameters": {"type": "object"}}}],
      "messages": [
          {"role": "system", "content": "S"},
          {"role": "user", "content": "u1"},
          {"role": "assistant", "content": "calling", "reasoning_content": "why",
           "tool_calls": [{"id": "call_1", "type": "function",
                           "function": {"name": "read", "arguments": "{\"p\": 1}"}},
                          {"id": "call_2", "type": "function",
                           "function": {"name": "read", "arguments": "{\"p\": 2}"}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "r1"},
          {"role": "tool", "tool_call_id": "call_2", "content": "r2"},
          {"role": "system", "content": "reminder"},
          {"role": "user", "content": "u2"}]}


def test_openai_request_round_trips_through_anthropic() -> None:
    an = openai_to_anthropic_request(OA)
    assert an["system"] == "S" and an["max_tokens"] == 77 and an["stop_sequences"] == ["X"]
    assert an["tool_choice"] == {"type": "any"}
    assert [m["role"] for m in an["messages"]] == ["user", "assistant", "user", "system", "user"]
    assert [b["type"] for b in an["messages"][2]["content"]] == ["tool_result", "tool_result"]
    back = anthropic_to_openai_request(an)
    msgs = [{k: v for k, v in m.items()} for m in back["messages"]]
    for m in msgs:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    want = json.loads(json.dumps(OA["messages"]))
    for m in want:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    assert msgs == want
    assert back["tools"] == OA["tools"] and back["tool_choice"] == "required"
    assert back["stream_options"] == {"include_usage": True}


def test_anthropic_blocks_map_in_order() -> None:
    body = {"model": "m", "max_tokens": 5, "thinking": {"type": "disabled"},
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [
                    {"type": "text", "text": "R"}]},
                {"type": "text", "text": "then"}]}],
            "tool_choice": {"type": "tool", "name": "read"}}
    oa = anthropic_to_openai_request(body)
    assert oa["messages"] == [{"role": "system", "content": "a\nb"},
                              {"role": "tool", "tool_call_id": "t", "content": "R"},
                              {"role": "user", "content": "then"}]
    assert oa["chat_template_kwargs"] == {"enable_thinking": False}
    assert oa["tool_choice"] == {"type": "function", "function": {"name": "read"}}
    with pytest.raises(TranslationError, match="image"):
        anthropic_to_openai_request({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]})


def test_responses_and_usage_conventions() -> None:
    oa = {"id": "chatcmpl-7", "choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": "hi", "reasoning_content": "r"}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 80}}}
    an = openai_to_anthropic_response(oa, "claude-x")
    assert an["stop_reason"] == "max_tokens" and an["model"] == "claude-x"
    assert an["usage"] == {"input_tokens": 20, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": 80, "output_tokens": 5}
    assert an["content"][0]["type"] == "thinking" and an["content"][0]["signature"]
    back = anthropic_to_openai_response(an, "m")
    assert back["usage"]["prompt_tokens"] == 100
    assert back["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    assert back["choices"][0]["finish_reason"] == "length"
    assert back["choices"][0]["message"] == {"role": "assistant", "content": "hi",
                                             "reasoning_content": "r"}
    # a response without usage still has every Anthropic usage field (Claude Code reads them)
    bare = openai_to_anthropic_response({"choices": [{"message": {"content": "x"}}]}, "m")
    assert set(bare["usage"]) == {"input_tokens", "cache_creation_input_tokens",
                                  "cache_read_input_tokens", "output_tokens"}


def _names(frames: list[str]) -> list[str]:
    return [f.split("\n", 1)[0][7:] for f in frames if f.startswith("event: ")]


def test_translated_stream_is_emitted_exactly_once() -> None:
    """Was (issue 28 item 7): every Anthropic stream translated from an OpenAI upstream was sent
    twice: `[DONE]` ended it, then the relay's end of body called `end()` again, which had no
    guard and started a second `message_start` ... `message_stop` (Claude Code then counted the
    input tokens twice)."""
    from freetoken.proxy.translate_stream import AnthropicToOpenAI, OpenAIToAnthropic

    tr = OpenAIToAnthropic("msg_1", "m")
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    fin = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    frames = tr.push(chunk) + tr.push(fin) + tr.push("[DONE]") + tr.end() + tr.end()
    names = _names(frames)
    assert names.count("message_start") == 1 and names.count("message_stop") == 1
    assert names[-1] == "message_stop" and tr.complete
    # an upstream error ends it: no clean end of turn after the error event
    tr = OpenAIToAnthropic("msg_2", "m")
    frames = tr.push(chunk) + tr.push({"error": {"message": "boom"}}) + tr.push("[DONE]")
    frames += tr.end()
    assert _names(frames)[-1] == "error" and "message_delta" not in _names(frames)
    # a stream cut off before its finish is not complete (the relay reports it as an error)
    tr = OpenAIToAnthropic("msg_3", "m")
    tr.push(chunk)
    assert not tr.complete
    back = AnthropicToOpenAI("c", "m", include_usage=False)
    out = back.push("message_stop", {"type": "message_stop"}) + back.end()
    assert out.count("data: [DONE]\n\n") == 1
