"""Issue 9, item 5: one validation pass per API and one admission check per request.

The server's refusal of a malformed chat body is the chat walk's own (same message, same param:
no second validator with its own wording in front of it); typed Anthropic server tools get the
walk's answer on every route; and a request is admitted once, on the engine thread, with a
refusal reported to the HTTP layer as a 400 in the API's shape."""
from __future__ import annotations

import copy
import threading

import httpx
import pytest
from server_helpers import Server
from test_errors import AN, OA, USER

from freetoken.chat import ChatInputError, anthropic_request, anthropic_to_template, openai_request
from freetoken.engine.async_engine import AsyncEngine
from freetoken.server import create_app
from freetoken.types.api import AdmissionError, EngineEvent, GenerateRequest

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
OPENAI_BAD = [
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": USER + [{"role": "tool", "tool_call_id": "nope", "content": "r"}]},
    {"messages": USER + [{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{not json"}}]}]},
    {"messages": USER, "tools": [TOOL, TOOL]},
    {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
    {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "g"}},
     "tools": [TOOL]},
    {"messages": USER, "chat_template_kwargs": {"enable_thinking": "yes"}},
]
ATOOL = {"name": "f", "input_schema": {"type": "object"}}
ANTHROPIC_BAD = [
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
    {"messages": USER, "system": [{"type": "text", "text": 3}]},
    {"messages": USER, "tools": [ATOOL, ATOOL]},
    {"messages": USER, "thinking": {"type": "sometimes"}},
    {"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
]


def _walk_error(fn, body: dict) -> ChatInputError:
    with pytest.raises(ChatInputError) as e:
        fn(copy.deepcopy(body))
    return e.value


@pytest.mark.parametrize("i", range(len(OPENAI_BAD)))
def test_openai_refusal_is_the_walks_own(server: Server, i: int) -> None:
    want = _walk_error(openai_request, OPENAI_BAD[i])
    r = httpx.post(server.url + "/v1/chat/completions", headers=OA,
                   json={"model": "m", **OPENAI_BAD[i]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["param"]) == (want.message, want.param)


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("i", range(len(ANTHROPIC_BAD)))
def test_anthropic_refusal_is_the_walks_own(server: Server, i: int, route: str) -> None:
    want = _walk_error(anthropic_request, ANTHROPIC_BAD[i])
    r = httpx.post(server.url + route, headers=AN,
                   json={"model": "m", "max_tokens": 5, **ANTHROPIC_BAD[i]})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"type": "invalid_request_error", "message": want.message}


@pytest.mark.parametrize("tool", [
    ATOOL, {**ATOOL, "type": "custom"}, {"type": "bash_20250124", "name": "bash"},
    {"type": "web_search_20250305", "name": "web_search", "input_schema": {"type": "object"}},
])
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_typed_server_tools_same_answer_on_every_path(server: Server, tool: dict,
                                                      route: str) -> None:
    """Issue 9: the server accepted typed server tools that the chat mapping refused. The
    routes, the strict walk and the lenient mapping (the proxy's) must give one answer."""
    body = {"model": "m", "max_tokens": 5, "messages": USER, "tools": [tool]}
    answers = set()
    for fn in (anthropic_request, anthropic_to_template):
        try:
            fn(copy.deepcopy(body))
            answers.add(True)
        except ChatInputError:
            answers.add(False)
    r = httpx.post(server.url + route, headers=AN, json=body)
    answers.add(r.status_code == 200)
    assert len(answers) == 1, (answers, r.text)


class CheckingCore:
    """The part of EngineCore that AsyncEngine drives; `check` refuses seed 13 (a rule the
    server cannot know) and records the thread it ran on."""

    max_context = 4096

    def close(self) -> None:  # the core contract: threads released at shutdown (none here)
        pass

    def __init__(self) -> None:
        self.checks: list[str] = []

    def check(self, req: GenerateRequest) -> None:
        self.checks.append(threading.current_thread().name)
        if req.sampling.seed == 13:
            raise AdmissionError("seed 13 is refused by this engine", "seed", "refused")

    def add(self, req: GenerateRequest, emit) -> None:
        self.check(req)
        emit(EngineEvent([], True, "length", len(req.input_ids), 0))

    def abort(self, rid: str) -> None:
        pass

    def has_work(self) -> bool:
        return False


def test_one_admission_check_on_the_engine_thread(tok) -> None:
    core = CheckingCore()
    eng = AsyncEngine(core, None, "stub")  # type: ignore[arg-type]
    s = Server(create_app(eng, tok, api_key=None, served_model_names=["m"]))
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "m", "messages": USER})
        assert r.status_code == 200, r.text
        assert core.checks == ["ft-engine"]
        r = httpx.post(s.url + "/v1/chat/completions",
                       json={"model": "m", "messages": USER, "seed": 13})
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("seed", "refused") and "seed 13" in err["message"]
        r = httpx.post(s.url + "/v1/messages",
                       json={"model": "m", "max_tokens": 5, "messages": USER, "seed": 13})
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert core.checks == ["ft-engine"] * 3
    finally:
        s.stop()
        eng.shutdown()
