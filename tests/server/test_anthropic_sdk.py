"""The official anthropic SDK against the server: messages streamed and not, thinking on/off,
a tool_use round trip, stop sequences, count_tokens, usage with cache reads."""
from __future__ import annotations

import anthropic
import httpx
import pytest
from server_helpers import API_KEY, FakeEngine, Server

from freetoken.server import anthropic_routes

TOOL_SCRIPT = ('<think>\nNeed the listing.\n</think>\n\nChecking.\n<tool_call>\n'
               '{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>')
TOOLS = [{"name": "Bash", "description": "Run a command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]


@pytest.fixture()
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def test_message_with_thinking(client: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.script = lambda req: "<think>\nhmm, 4\n</think>\n\nIt is 4."
    r = client.messages.create(model="claude-opus-4-8", max_tokens=16000,
                               thinking={"type": "enabled", "budget_tokens": 2000},
                               messages=[{"role": "user", "content": "2+2?"}])
    assert r.model == "claude-opus-4-8"
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking.strip() == "hmm, 4" and r.content[0].signature
    assert r.content[1].text.strip() == "It is 4."
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    n = len(engine.requests[-1].input_ids)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == n
    assert r.usage.output_tokens == len(engine.tok.encode(engine.script(None))) + 1


def test_thinking_disabled(client: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.script = lambda req: "Just text."
    r = client.messages.create(model="m", max_tokens=100, thinking={"type": "disabled"},
                               messages=[{"role": "user", "content": "hi"}])
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Just text."
    assert engine.tok.decode(engine.requests[-1].input_ids).endswith("<think>\n\n</think>\n\n")


def test_stream_matches_non_stream(client: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.script = lambda req: TOOL_SCRIPT
    kw: dict = {"model": "m", "max_tokens": 500, "tools": TOOLS,
                "messages": [{"role": "user", "content": "list"}]}
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    plain = client.messages.create(**kw)
    for m in (streamed, plain):
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
        assert m.content[2].name == "Bash" and m.content[2].input == {"command": "ls -la"}
        assert m.stop_reason == "tool_use"
    assert streamed.content[0].thinking == plain.content[0].thinking
    assert streamed.content[0].signature == plain.content[0].signature
    assert streamed.usage.output_tokens == plain.usage.output_tokens
    # the second, identical prompt was served from the fake prefix cache
    assert plain.usage.cache_read_input_tokens == len(engine.requests[-1].input_ids) - 1


def test_pings_before_message_start_are_accepted(client: anthropic.Anthropic, engine: FakeEngine,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28: keep-alives before the first token are `ping` events; the SDK (Claude Code
    streams through its TypeScript twin, which skips `ping` the same way) must still assemble
    the message: an event before `message_start` it did not skip would raise 'Unexpected event
    order'."""
    monkeypatch.setattr(anthropic_routes, "KEEPALIVE_S", 0.05)
    engine.script = lambda req: "late but fine"
    engine.first_delay_s = 0.3
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    text = httpx.post(str(client.base_url.join("/v1/messages")), json={**body, "stream": True},
                      headers={"x-api-key": API_KEY}).text
    assert text.startswith("event: ping\n") and text.count("event: ping") >= 3
    with client.messages.stream(**body) as s:
        msg = s.get_final_message()
    assert msg.content[0].text == "late but fine" and msg.stop_reason == "end_turn"


def test_tool_round_trip(client: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.script = lambda req: TOOL_SCRIPT
    msgs: list = [{"role": "user", "content": "list"}]
    r = client.messages.create(model="m", max_tokens=500, tools=TOOLS, messages=msgs)
    use = r.content[-1]
    assert use.type == "tool_use"
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "total 0\nREADME.md",
                                           "cache_control": {"type": "ephemeral"}}]}]
    engine.script = lambda req: "One file: README.md."
    r2 = client.messages.create(model="m", max_tokens=500, tools=TOOLS, messages=msgs,
                                extra_headers={"X-Claude-Code-Session-Id": "sess-1"})
    assert r2.content[0].text == "One file: README.md." and r2.stop_reason == "end_turn"
    prompt = engine.tok.decode(engine.requests[-1].input_ids)
    assert "<tool_response>\ntotal 0\nREADME.md\n</tool_response>" in prompt
    assert '{"name": "Bash", "arguments": {"command": "ls -la"}}' in prompt
    assert engine.requests[-1].session_key == "sess-1"


def test_stop_sequence(client: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.script = lambda req: "first line\nEND\nsecond"
    r = client.messages.create(model="m", max_tokens=100, stop_sequences=["END"],
                               messages=[{"role": "user", "content": "x"}])
    assert r.content[0].text == "first line\n"
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "END"


def test_max_tokens_stop_reason(client: anthropic.Anthropic, engine: FakeEngine) -> None:
    engine.script = lambda req: "a b c d e f g h i j k l m n o p"
    r = client.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_count_tokens(client: anthropic.Anthropic, engine: FakeEngine) -> None:
    msgs = [{"role": "user", "content": "count me"}]
    n = client.messages.count_tokens(model="m", messages=msgs, tools=TOOLS).input_tokens
    client.messages.create(model="m", max_tokens=5, messages=msgs, tools=TOOLS)
    assert n == len(engine.requests[-1].input_ids)
