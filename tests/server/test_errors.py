"""Bad input gets a 4xx in the API's own error shape, never a 5xx; auth, 404 and 405; and a
hypothesis fuzz of request bodies after which the server still serves a valid request."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import API_KEY, MAX_CONTEXT, FakeEngine, Server

OA = {"Authorization": f"Bearer {API_KEY}"}
AN = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
USER = [{"role": "user", "content": "hi"}]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "*") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "*":
        assert err["param"] == param
    return err


def assert_anthropic_error(r: httpx.Response, status: int, etype: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == etype and body["error"]["message"]
    return body["error"]


OPENAI_BAD: dict[str, tuple[Any, str | None]] = {
    "not_json": (b"{not json", None),
    "json_array": ([1, 2], None),
    "empty_body": (b"", None),
    "missing_model": ({"messages": USER}, "model"),
    "model_not_string": ({"model": 3, "messages": USER}, "model"),
    "missing_messages": ({"model": "m"}, "messages"),
    "empty_messages": ({"model": "m", "messages": []}, "messages"),
    "messages_not_list": ({"model": "m", "messages": "hi"}, "messages"),
    "message_not_object": ({"model": "m", "messages": ["hi"]}, "messages[0]"),
    "bad_role": ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
                 "messages[0].role"),
    "content_number": ({"model": "m", "messages": [{"role": "user", "content": 5}]},
                       "messages[0].content"),
    "part_text_not_string": ({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
    "negative_temperature": ({"model": "m", "messages": USER, "temperature": -1}, "temperature"),
    "absurd_temperature": ({"model": "m", "messages": USER, "temperature": 1e9}, "temperature"),
    "nan_temperature": ((b'{"model":"m","messages":[{"role":"user","content":"x"}],'
                         b'"temperature":NaN}'), "temperature"),
    "temperature_string": ({"model": "m", "messages": USER, "temperature": "hot"}, "temperature"),
    "top_p_zero": ({"model": "m", "messages": USER, "top_p": 0}, "top_p"),
    "top_p_above_one": ({"model": "m", "messages": USER, "top_p": 1.5}, "top_p"),
    "top_k_negative": ({"model": "m", "messages": USER, "top_k": -5}, "top_k"),
    "seed_negative": ({"model": "m", "messages": USER, "seed": -1}, "seed"),
    "max_tokens_zero": ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens"),
    "max_tokens_negative": ({"model": "m", "messages": USER, "max_tokens": -10}, "max_tokens"),
    "max_tokens_float": ({"model": "m", "messages": USER, "max_tokens": 1.5}, "max_tokens"),
    "max_tokens_bool": ({"model": "m", "messages": USER, "max_tokens": True}, "max_tokens"),
    "max_completion_tokens_string": ({"model": "m", "messages": USER,
                                      "max_completion_tokens": "10"}, "max_completion_tokens"),
    "n_two": ({"model": "m", "messages": USER, "n": 2}, "n"),
    "stream_not_bool": ({"model": "m", "messages": USER, "stream": "yes"}, "stream"),
    "stop_number": ({"model": "m", "messages": USER, "stop": 5}, "stop"),
    "stop_empty_string": ({"model": "m", "messages": USER, "stop": [""]}, "stop"),
    "min_tokens_over_max": ({"model": "m", "messages": USER, "max_tokens": 5, "min_tokens": 9},
                            "min_tokens"),
    "tools_not_list": ({"model": "m", "messages": USER, "tools": {}}, "tools"),
    "tool_no_function": ({"model": "m", "messages": USER, "tools": [{"type": "function"}]},
                         "tools[0].function"),
    "tool_name_missing": ({"model": "m", "messages": USER, "tools": [
        {"type": "function", "function": {"parameters": {"type": "object"}}}]},
        "tools[0].function.name"),
    "tool_schema_not_object": ({"model": "m", "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters"),
    "tool_schema_required_not_list": ({"model": "m", "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "required": "x"}}}]}, "tools[0].function.parameters.required"),
    "tool_choice_unknown_name": ({"model": "m", "messages": USER, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    "tool_choice_bad_string": ({"model": "m", "messages": USER, "tool_choice": "always"},
                               "tool_choice"),
    "tool_call_args_bad": ({"model": "m", "messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": 7}}]}]},
        "messages[1].tool_calls[0].function.arguments"),
    "logprobs": ({"model": "m", "messages": USER, "logprobs": True}, "logprobs"),
    "response_format_json_schema": ({"model": "m", "messages": USER, "response_format": {
        "type": "json_schema"}}, "response_format"),
    "deeply_nested": ({"model": "m", "messages": USER, "x": json.loads("[" * 100 + "]" * 100)},
                      None),
    "prompt_too_long": ({"model": "m", "messages": [{"role": "user",
                                                      "content": "word " * (MAX_CONTEXT + 10)}]},
                        "messages"),
}


@pytest.mark.parametrize("case", sorted(OPENAI_BAD))
def test_openai_bad_input(server: Server, engine: FakeEngine, case: str) -> None:
    body, param = OPENAI_BAD[case]
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, **kw,
                   headers={**OA, "content-type": "application/json"})
    err = assert_openai_error(r, 400)
    if param is not None:
        assert err["param"] == param, err
    assert engine.requests == []  # refused before reaching the engine


ANTHROPIC_BAD: dict[str, dict] = {
    "missing_max_tokens": {"model": "m", "messages": USER},
    "max_tokens_zero": {"model": "m", "max_tokens": 0, "messages": USER},
    "missing_model": {"max_tokens": 5, "messages": USER},
    "empty_messages": {"model": "m", "max_tokens": 5, "messages": []},
    "bad_role": {"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
    "missing_content": {"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]},
    "block_without_type": {"model": "m", "max_tokens": 5,
                           "messages": [{"role": "user", "content": [{"text": "x"}]}]},
    "tool_use_input_string": {"model": "m", "max_tokens": 5, "messages": USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": "x"}]}]},
    "system_number": {"model": "m", "max_tokens": 5, "system": 4, "messages": USER},
    "tool_without_schema": {"model": "m", "max_tokens": 5, "messages": USER,
                            "tools": [{"name": "f"}]},
    "tool_schema_array": {"model": "m", "max_tokens": 5, "messages": USER,
                          "tools": [{"name": "f", "input_schema": {"type": "array"}}]},
    "tool_choice_unknown": {"model": "m", "max_tokens": 5, "messages": USER,
                            "tool_choice": {"type": "tool", "name": "zzz"}},
    "stop_sequences_string_list": {"model": "m", "max_tokens": 5, "messages": USER,
                                   "stop_sequences": [1]},
    "temperature_negative": {"model": "m", "max_tokens": 5, "messages": USER, "temperature": -0.5},
    "thinking_bad_type": {"model": "m", "max_tokens": 5, "messages": USER,
                          "thinking": {"type": "sometimes"}},
}


@pytest.mark.parametrize("case", sorted(ANTHROPIC_BAD))
def test_anthropic_bad_input(server: Server, engine: FakeEngine, case: str) -> None:
    r = httpx.post(server.url + "/v1/messages", headers=AN, json=ANTHROPIC_BAD[case], timeout=30)
    assert_anthropic_error(r, 400, "invalid_request_error")
    assert engine.requests == []


def test_auth(server: Server) -> None:
    body = {"model": "m", "messages": USER}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={"Authorization": "Bearer wrong"})
    assert_openai_error(r, 401)
    assert httpx.post(server.url + "/v1/chat/completions", json=body,
                      headers={"x-api-key": API_KEY}).status_code == 200
    r = httpx.post(server.url + "/v1/messages", json={**body, "max_tokens": 5},
                   headers={"x-api-key": "nope"})
    assert_anthropic_error(r, 401, "authentication_error")
    assert httpx.post(server.url + "/v1/messages", json={**body, "max_tokens": 5},
                      headers=OA).status_code == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_not_found_and_method(server: Server) -> None:
    assert_openai_error(httpx.post(server.url + "/v1/nothing", headers=OA), 404)
    assert_anthropic_error(httpx.post(server.url + "/v1/messages/nothing", headers=AN), 404,
                           "not_found_error")
    assert_openai_error(httpx.get(server.url + "/v1/chat/completions", headers=OA), 405)
    assert_anthropic_error(httpx.get(server.url + "/v1/messages", headers=AN), 405,
                           "invalid_request_error")


def test_strict_model(tok: object) -> None:
    from server_helpers import FakeEngine as FE
    from server_helpers import Server as S

    from freetoken.server import create_app

    s = S(create_app(FE(tok), tok, api_key=None, served_model_names=["only"], strict_model=True))
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "other", "messages": USER})
        assert assert_openai_error(r, 404, "model")["code"] == "model_not_found"
        r = httpx.post(s.url + "/v1/messages", json={"model": "other", "max_tokens": 5,
                                                     "messages": USER})
        assert_anthropic_error(r, 404, "not_found_error")
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "only", "messages": USER})
        assert r.status_code == 200  # no api key configured: open
    finally:
        s.stop()


JSONV = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**20) | st.floats()
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3)
    | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8)
MSG = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", 3]),
                             "content": JSONV | st.text(max_size=10)},
                            optional={"tool_calls": JSONV, "reasoning_content": JSONV})
FIELDS = {"model": st.text(max_size=5) | JSONV, "messages": st.lists(MSG, max_size=3) | JSONV,
          "max_tokens": JSONV, "temperature": JSONV, "top_p": JSONV, "stop": JSONV,
          "stream": st.booleans() | JSONV, "tools": JSONV, "tool_choice": JSONV, "n": JSONV,
          "system": JSONV, "thinking": JSONV, "stop_sequences": JSONV, "top_k": JSONV,
          "seed": JSONV, "max_completion_tokens": JSONV, "stream_options": JSONV}
VALID = {"model": "m", "max_tokens": 5, "messages": USER}
# random bodies, plus valid ones with one field replaced (these reach deeper validation)
BODY = st.fixed_dictionaries({}, optional=FIELDS) | st.builds(
    lambda k, v: {**VALID, k: v}, st.sampled_from(sorted(FIELDS)), JSONV)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY, path=st.sampled_from(["/v1/chat/completions", "/v1/messages",
                                        "/v1/messages/count_tokens", "/v1/completions"]))
def test_fuzz_never_5xx(_server: Server, engine: FakeEngine, body: dict, path: str) -> None:
    engine.reset()
    engine.script = lambda req: "ok"
    # NaN / Infinity are sent as Python writes them: the server must refuse them, not crash
    r = httpx.post(_server.url + path, headers={**OA, **AN, "content-type": "application/json"},
                   content=json.dumps(body), timeout=30)
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        j = r.json()
        if path.startswith("/v1/messages"):
            assert j["type"] == "error" and isinstance(j["error"]["message"], str)
        else:
            assert isinstance(j["error"]["message"], str) and "param" in j["error"]
    elif body.get("stream") is True and path != "/v1/messages/count_tokens":
        assert "error" not in r.text
    ok = httpx.post(_server.url + "/v1/chat/completions", headers=OA,
                    json={"model": "m", "messages": USER})
    assert ok.status_code == 200
