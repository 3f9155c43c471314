"""`POST /v1/responses` through `ft agent-proxy --upstream` (issue 28 item 4: "on the proxy, any
engine behind it"), against mocked upstreams that speak only OpenAI chat or only Anthropic: the
Responses request goes upstream as chat (or chat translated to Anthropic), the answer comes back
as Responses events the OpenAI SDK parses, in the API's order, with the upstream's own cached
tokens as `input_tokens_details.cached_tokens`, the output cap applied, and
`previous_response_id` continuing the stored conversation."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from upstream_fakes import UP, Events, an_stream, oa_chunk, oa_stream, start_proxy

SSE = {"content-type": "text/event-stream"}
TOOLS = [{"type": "function", "name": "read", "description": "read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
         {"type": "web_search"}]  # hosted: accepted, not shown to the model


OA_REPLY = {"id": "chatcmpl-9", "object": "chat.completion", "created": 1, "model": "up",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "Reading.", "tool_calls": [
                    {"id": "call_Z", "type": "function",
                     "function": {"name": "read", "arguments": '{"path": "b"}'}}]}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 7, "total_tokens": 57,
                      "prompt_tokens_details": {"cached_tokens": 40}}}
AN_REPLY = {"id": "msg_9", "type": "message", "role": "assistant", "model": "up",
            "content": [{"type": "text", "text": "Reading."},
                        {"type": "tool_use", "id": "call_Z", "name": "read",
                         "input": {"path": "b"}}],
            "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 10, "cache_read_input_tokens": 40,
                      "cache_creation_input_tokens": 0, "output_tokens": 7}}


@pytest.fixture(params=["openai", "anthropic"])
def proxy(request):
    p = start_proxy({"upstream_api": request.param, "caps": {"*": 300}, "ping_s": 0.05,
                     "metrics_path": None})
    p.api = request.param

    def side(req: httpx.Request) -> httpx.Response:
        p.seen.append(req)
        if not json.loads(req.content).get("stream"):
            return httpx.Response(200, json=OA_REPLY if p.api == "openai" else AN_REPLY)
        frames = oa_stream() if p.api == "openai" else an_stream()
        return httpx.Response(200, headers=SSE, stream=Events(frames, delay=0.002))

    path = "/v1/chat/completions" if p.api == "openai" else "/v1/messages"
    p.router.post(UP + path).mock(side_effect=side)
    yield p
    p.server.stop()


def test_streamed_responses_through_any_upstream(proxy) -> None:
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k")
    events = list(c.responses.create(model="m", instructions="Be brief.", input="read it",
                                     tools=TOOLS, stream=True, max_output_tokens=64000))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert call.name == "read" and call.arguments == '{"path": "README.md"}'
    assert final.output[1].content[0].text == "Reading it."
    # the upstream's own counter: 100 cached of 120 (OpenAI prompt_tokens_details, or
    # Anthropic cache_read_input_tokens + input_tokens)
    assert final.usage.input_tokens == 120
    assert final.usage.input_tokens_details.cached_tokens == 100
    sent = proxy.last_json()
    if proxy.api == "openai":
        assert [m["role"] for m in sent["messages"]] == ["system", "user"]
        assert [t["function"]["name"] for t in sent["tools"]] == ["read"]
        assert sent["max_tokens"] == 300  # the proxy's cap, not the client's 64000
    else:
        assert sent["system"] == "Be brief." and sent["messages"][0]["role"] == "user"
        assert [t["name"] for t in sent["tools"]] == ["read"]
        assert sent["max_tokens"] == 300


def test_previous_response_id_through_an_upstream(proxy) -> None:
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k")
    first = c.responses.create(model="m", input="read it", tools=TOOLS)
    assert first.status == "completed" and first.output[-1].type == "function_call"
    assert first.usage.input_tokens == 50 and first.usage.input_tokens_details.cached_tokens == 40
    call_id = first.output[-1].call_id
    c.responses.create(model="m", previous_response_id=first.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call_id, "output": "README text"}])
    sent = proxy.last_json()
    if proxy.api == "openai":
        roles = [m["role"] for m in sent["messages"]]
        assert roles == ["user", "assistant", "tool"], roles
        assert sent["messages"][1]["tool_calls"][0]["id"] == call_id
        assert sent["messages"][2] == {"role": "tool", "tool_call_id": call_id,
                                       "content": "README text"}
    else:
        blocks = [b["type"] for b in sent["messages"][1]["content"]]
        assert "tool_use" in blocks, sent["messages"]
        assert sent["messages"][2]["content"][0] == {
            "type": "tool_result", "tool_use_id": call_id, "content": "README text"}
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", previous_response_id="resp_never", input="x")
    assert e.value.code == "previous_response_not_found"


def test_llama_cpp_reuse_counter_is_the_cached_tokens() -> None:
    """llama-server reports its prompt reuse as `timings.cache_n`, not in `usage`: Codex and
    Claude Code (translated to chat) are told that count, not 0 (issue 28 items 4 and 7:
    cached_tokens truthful, read from the upstream's own counters)."""
    p = start_proxy({"upstream_api": "openai", "metrics_path": None})
    usage = {"prompt_tokens": 120, "completion_tokens": 2, "total_tokens": 122}
    timings = {"cache_n": 97, "prompt_n": 23, "predicted_n": 2}

    def side(req: httpx.Request) -> httpx.Response:
        if not json.loads(req.content).get("stream"):
            return httpx.Response(200, json={
                "id": "c", "object": "chat.completion", "created": 1, "model": "q",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": "hi"}}], "usage": usage,
                "timings": timings})
        last = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "q",
                "choices": [], "usage": usage, "timings": timings}
        frames = [oa_chunk({"role": "assistant", "content": ""}), oa_chunk({"content": "hi"}),
                  oa_chunk({}, "stop"), "data: " + json.dumps(last) + "\n\n", "data: [DONE]\n\n"]
        return httpx.Response(200, headers=SSE, stream=Events(frames))

    p.router.post(UP + "/v1/chat/completions").mock(side_effect=side)
    try:
        c = openai.OpenAI(base_url=p.url + "/v1", api_key="k")
        r = c.responses.create(model="m", input="hi")
        assert r.usage.input_tokens == 120 and r.usage.input_tokens_details.cached_tokens == 97
        final = list(c.responses.create(model="m", input="hi", stream=True))[-1].response
        assert final.usage.input_tokens_details.cached_tokens == 97
        a = anthropic.Anthropic(base_url=p.url, api_key="k")
        msg = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        u = a.messages.create(**msg).usage
        assert (u.input_tokens, u.cache_read_input_tokens) == (23, 97)
        with a.messages.stream(**msg) as st:
            u = st.get_final_message().usage
        assert (u.input_tokens, u.cache_read_input_tokens) == (23, 97)
    finally:
        p.server.stop()
