"""`POST /v1/responses` on `ft serve` (FakeEngine, real Qwen3 tokenizer): the Responses object
and event shapes of the OpenAI API, in its order, function calls, Codex's tool kinds,
`previous_response_id` with `store`, and the errors in the OpenAI shape. Regression (issue 28):
`POST /v1/responses` was a 404, so Codex 0.171 (Responses only) retried five times and quit."""
from __future__ import annotations

import json

import httpx
import pytest

from freetoken.server.responses_routes import ResponseStore

TOOL = {"type": "function", "name": "exec_command", "description": "run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                       "required": ["cmd"]}}
CODEX_TOOLS = [TOOL, {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                      "tools": [{"type": "function", "name": "spawn_agent", "description": "x",
                                 "parameters": {"type": "object", "properties": {}}}]},
               {"type": "web_search", "external_web_access": False}]
CALL = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'


def _events(text: str) -> list[dict]:
    out = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        ev = next((x[7:] for x in lines if x.startswith("event: ")), None)
        data = next((x[6:] for x in lines if x.startswith("data: ")), None)
        if data is not None:
            d = json.loads(data)
            assert d["type"] == ev, "the SSE event name is the payload's type"
            out.append(d)
    return out


def _post(server, auth, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, headers=auth, timeout=30)


def test_text_reply_streamed_in_the_apis_order(server, engine, auth) -> None:
    engine.script = lambda req: "<think>\nhmm\n</think>\n\nHello there."
    r = _post(server, auth, {"model": "m", "input": "hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = _events(r.text)
    kinds = [e["type"] for e in evs]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    i = kinds.index("response.content_part.added")
    assert kinds[i - 1] == "response.output_item.added"
    assert kinds[i + 1] == "response.output_text.delta"
    j = kinds.index("response.output_text.done")
    assert set(kinds[i + 1:j]) == {"response.output_text.delta"}
    assert kinds[j + 1:j + 3] == ["response.content_part.done", "response.output_item.done"]
    assert "response.reasoning_summary_text.delta" in kinds[:i]  # reasoning item first
    final = evs[-1]["response"]
    assert final["status"] == "completed" and final["object"] == "response"
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Hello there."
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert text == "Hello there."
    u = final["usage"]
    assert u["input_tokens"] > 0 and u["output_tokens"] > 0
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]


def test_function_call_non_streamed_and_streamed(server, engine, auth) -> None:
    engine.script = lambda req: CALL
    body = {"model": "m", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "list"}]}], "tools": CODEX_TOOLS, "store": False}
    r = _post(server, auth, body)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["function_call"]
    assert out[0]["name"] == "exec_command" and json.loads(out[0]["arguments"]) == {"cmd": "ls"}
    assert out[0]["call_id"] and out[0]["status"] == "completed"
    # the model saw the function and the namespace's tool, not the hosted web_search
    prompt = engine.tok.decode(engine.requests[-1].input_ids)
    assert "exec_command" in prompt and "spawn_agent" in prompt and "web_search" not in prompt
    evs = _events(_post(server, auth, {**body, "stream": True}).text)
    kinds = [e["type"] for e in evs]
    a = kinds.index("response.output_item.added")
    assert evs[a]["item"]["type"] == "function_call" and evs[a]["item"]["arguments"] == ""
    d = kinds.index("response.function_call_arguments.done")
    args = "".join(e["delta"] for e in evs if e["type"] ==
                   "response.function_call_arguments.delta")
    assert args == evs[d]["arguments"] and json.loads(args) == {"cmd": "ls"}
    assert kinds[d + 1] == "response.output_item.done" and kinds[-1] == "response.completed"


def test_previous_response_id_continues_stored_state(server, engine, auth) -> None:
    engine.script = lambda req: "First answer."
    r1 = _post(server, auth, {"model": "m", "input": "question one"}).json()
    engine.script = lambda req: "Second answer."
    r2 = _post(server, auth, {"model": "m", "input": "question two",
                              "previous_response_id": r1["id"]})
    assert r2.status_code == 200, r2.text
    prompt = engine.tok.decode(engine.requests[-1].input_ids)
    assert prompt.index("question one") < prompt.index("First answer.") < prompt.index(
        "question two")
    # the continued prompt extends the first one: the prefix cache reuses it
    assert r2.json()["usage"]["input_tokens_details"]["cached_tokens"] >= len(
        engine.requests[0].input_ids) - 1
    got = httpx.get(server.url + f"/v1/responses/{r1['id']}", headers=auth).json()
    assert got["id"] == r1["id"] and got["output"][0]["content"][0]["text"] == "First answer."
    gone = _post(server, auth, {"model": "m", "input": "x", "previous_response_id": "resp_no"})
    assert gone.status_code == 400
    err = gone.json()["error"]
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    # store: false keeps nothing
    r3 = _post(server, auth, {"model": "m", "input": "q", "store": False}).json()
    assert _post(server, auth, {"model": "m", "input": "x",
                                "previous_response_id": r3["id"]}).status_code == 400


@pytest.mark.parametrize("body,param", [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": 3}, "input"),
    ({"model": "m", "input": "x", "tools": [{"type": "computer_use", "x": 1}]}, "tools[0].type"),
    ({"model": "m", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:"}]}]}, "input[0].content[0].type"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
])
def test_bad_requests_are_clear_400s_in_the_openai_shape(server, auth, body, param) -> None:
    r = _post(server, auth, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.mark.parametrize("raw,param", [
    # issue 22's fuzz of /v1/responses (0 5xx on every front): each of these was a 500
    (b'{"model": "m", "input": "x", "tools": [{"type": ["function"], "name": "f"}]}',
     "tools[0].type"),  # TypeError: unhashable type (the hosted-tools set)
    (b'{"model": "m", "input": "x", "tools": [{"type": {"a": 1}}]}', "tools[0].type"),
    (b'{"model": "m", "input": "x", "tools": [TOOL], "tool_choice": {"type": [1]}}',
     "tool_choice"),
    ((b'{"model": "m", "input": [{"type": "message", "role": "user", "content": [{"type": '
      b'["input_text"], "text": "x"}]}]}'), "input[0].content[0].type"),
    # the response echoes the request's fields: an out-of-range float cannot be written back
    ((b'{"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", '
      b'"parameters": Infinity}]}'), None),
    (b'{"model": "m", "input": "x", "metadata": {"a": NaN}}', None),
])
def test_former_500s_are_400s(server, auth, raw: bytes, param: str | None) -> None:
    raw = raw.replace(b"TOOL", json.dumps(TOOL).encode())
    for stream in (b"false", b"true"):
        r = httpx.post(server.url + "/v1/responses", headers={**auth, "content-type":
                       "application/json"}, content=raw[:-1] + b', "stream": ' + stream + b"}")
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_cap_and_length_end_as_incomplete(server, engine, auth) -> None:
    engine.script = lambda req: "a b c d e f g h i j k l m n o p"
    r = _post(server, auth, {"model": "m", "input": "x", "max_output_tokens": 3}).json()
    assert r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    evs = _events(_post(server, auth, {"model": "m", "input": "x", "max_output_tokens": 3,
                                       "stream": True}).text)
    assert evs[-1]["type"] == "response.incomplete"


def test_server_cap_ends_as_a_normal_completed_turn(server, engine, auth) -> None:
    """`ft serve --max-output-tokens` (256 on the demo) cut the reply, not the client's own
    limit: a normal end of turn (`completed`), as on the other APIs, with the cap header."""
    engine.script = lambda req: "a b c d e f g h i j k l m n o p"
    engine.max_output_tokens = 3
    try:
        r = _post(server, auth, {"model": "m", "input": "x", "max_output_tokens": 64000})
        assert r.headers["x-ft-output-cap"] == "3"
        out = r.json()
        assert out["status"] == "completed" and out["incomplete_details"] is None
        assert out["usage"]["output_tokens"] == 3
        evs = _events(_post(server, auth, {"model": "m", "input": "x", "stream": True}).text)
        assert evs[-1]["type"] == "response.completed"
        assert evs[-1]["response"]["usage"]["output_tokens"] == 3
    finally:
        engine.max_output_tokens = None


def test_store_is_bounded_lru() -> None:
    s = ResponseStore(max_responses=2)
    for i in range(3):
        s.put(f"r{i}", [{"i": i}], {"id": f"r{i}"})
    assert s.get("r0") is None and s.get("r1") is not None and len(s) == 2
    s.put("r3", [], {"id": "r3"})  # r1 was used last: r2 goes
    assert s.get("r2") is None and s.get("r1") is not None
    small = ResponseStore(max_bytes=200)
    small.put("a", ["x" * 100], {"id": "a"})
    small.put("b", ["y" * 100], {"id": "b"})
    assert small.get("a") is None and small.get("b") is not None and small.bytes <= 200
