"""The official openai SDK against the server: chat (streamed and not), tools, thinking, stops,
completions, models, usage and the max_tokens clamp."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_helpers import API_KEY, MAX_CONTEXT, FakeEngine, Server

THINK_TOOL = ('<think>\nI should list the files.\n</think>\n\nLet me look.\n<tool_call>\n'
              '{"name": "list_files", "arguments": {"path": "."}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "list_files", "description": "List files",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_chat_plain(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda req: "<think>\nponder\n</think>\n\nThe answer is 4."
    r = client.chat.completions.create(model="whatever-name", max_tokens=100,
                                       messages=[{"role": "user", "content": "2+2?"}])
    assert r.model == "whatever-name"
    m = r.choices[0].message
    assert m.content.strip() == "The answer is 4."
    assert m.reasoning_content == "ponder"  # type: ignore[attr-defined]
    assert r.choices[0].finish_reason == "stop"
    req = engine.requests[-1]
    assert r.usage.prompt_tokens == len(req.input_ids)
    # every emitted id (reasoning, text, end of turn) counts as a completion token
    script_ids = engine.tok.encode(engine.script(req))
    assert r.usage.completion_tokens == len(script_ids) + 1


def test_chat_stream_and_usage(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda req: "<think>\nstep one\n</think>\n\nDone here."
    msgs = [{"role": "user", "content": "go"}]
    stream = client.chat.completions.create(model="m", messages=msgs, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    assert text.strip() == "Done here." and reasoning.strip() == "step one"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(
        engine.requests[-1].input_ids)
    # second identical request: the fake cache reports the shared prefix as cached
    r = client.chat.completions.create(model="m", messages=msgs)
    assert r.usage.prompt_tokens_details.cached_tokens == len(engine.requests[-1].input_ids) - 1


def test_tool_round_trip(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda req: THINK_TOOL
    msgs: list = [{"role": "user", "content": "what files are here?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice="auto")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    call = ch.message.tool_calls[0]
    assert call.function.name == "list_files"
    assert json.loads(call.function.arguments) == {"path": "."}
    assert ch.message.content.strip() == "Let me look."
    first_prompt = engine.requests[-1].input_ids
    # follow-up carrying the assistant turn and the tool result
    msgs += [{"role": "assistant", "content": ch.message.content,
              "reasoning_content": ch.message.reasoning_content,  # type: ignore[attr-defined]
              "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "README.md\nsetup.py"}]
    engine.script = lambda req: "There are two files."
    r2 = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert r2.choices[0].message.content == "There are two files."
    assert r2.choices[0].finish_reason == "stop"
    prompt = engine.tok.decode(engine.requests[-1].input_ids)
    assert "<tool_response>\nREADME.md\nsetup.py\n</tool_response>" in prompt
    assert '"name": "list_files"' in prompt and "list_files" in engine.tok.decode(first_prompt)


def test_tool_call_streamed(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda req: THINK_TOOL
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "ls"}], tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "list_files"
    assert json.loads(calls[0].function.arguments) == {"path": "."}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_thinking_off_renders_empty_think(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda req: "Plain answer."
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Plain answer."
    assert engine.tok.decode(engine.requests[-1].input_ids).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tool_choice_none_drops_tools(client: openai.OpenAI, engine: FakeEngine) -> None:
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                   tools=TOOLS, tool_choice="none")
    assert "list_files" not in engine.tok.decode(engine.requests[-1].input_ids)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                   tools=TOOLS, tool_choice="required")
    assert "list_files" in engine.tok.decode(engine.requests[-1].input_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client: openai.OpenAI, engine: FakeEngine, stream: bool) -> None:
    engine.script = lambda req: "alpha beta STOP gamma delta epsilon"
    kw: dict = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                "stop": ["STOP", "zzz"]}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == "alpha beta " and finish == "stop"
    assert engine.aborted == [engine.requests[-1].request_id]  # generation stopped early


def test_max_tokens_length_and_clamp(server: Server, engine: FakeEngine) -> None:
    engine.script = lambda req: "one two three four five six seven eight nine ten"
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": 4}
    r = httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert (
        r.json()["usage"]["completion_tokens"] == 4 and "x-ft-max-tokens-clamped" not in r.headers
    )
    body["max_completion_tokens"] = 10**9
    r = httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    room = MAX_CONTEXT - len(engine.requests[-1].input_ids)
    assert r.status_code == 200
    assert r.headers["x-ft-max-tokens-clamped"] == str(room)
    assert engine.requests[-1].sampling.max_tokens == room


def test_sampling_and_extensions_reach_engine(client: openai.OpenAI, engine: FakeEngine) -> None:
    client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], temperature=0.3, top_p=0.9,
        seed=7, max_tokens=50, extra_body={"top_k": 20, "min_tokens": 2, "ignore_eos": True})
    sp = engine.requests[-1].sampling
    assert (sp.temperature, sp.top_p, sp.seed, sp.top_k, sp.min_tokens, sp.ignore_eos) == (
        0.3, 0.9, 7, 20, 2, True)
    assert sp.stop_token_ids == [] and sp.max_tokens == 50


def test_completions(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda req: " world, and more"
    r = client.completions.create(model="m", prompt="Hello", max_tokens=30, stop=[","])
    assert r.choices[0].text == " world" and r.choices[0].finish_reason == "stop"
    ids = engine.tok.encode("Hello there")
    r = client.completions.create(model="m", prompt=ids, max_tokens=30)
    assert engine.requests[-1].input_ids == ids
    assert r.choices[0].text == " world, and more" and r.usage.prompt_tokens == len(ids)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="Hi", max_tokens=30, stream=True))
    assert text == " world, and more"


def test_models(client: openai.OpenAI) -> None:
    data = client.models.list().data
    assert [m.id for m in data] == ["fake-qwen3", "alias"]
    assert data[0].model_extra["context_length"] == MAX_CONTEXT
    assert data[0].model_extra["max_model_len"] == MAX_CONTEXT
