"""gpt-oss's harmony chat end to end: the real engine on a tiny gpt-oss checkpoint with a harmony
vocabulary behind the real server, through the OpenAI chat, Anthropic messages and Responses
APIs, streamed and not.

A random model writes no harmony, so the tiny model is taught its answers: the checkpoint is
transformers' GptOssForCausalLM with random weights, and only its LM head is fitted (a linear
readout of the final hidden states, which depend on the whole prefix through full attention)
so that greedy decoding after each test's prompt writes a fixed harmony completion. The prompts
are the ids the server itself renders for the test bodies (recorded through a fake engine
first), so the fit holds exactly for them. Completions: with tools, an analysis message then a
`to=functions.get_weather` call (stop `<|call|>`); after the tool result, an analysis message then
a final answer (stop `<|return|>`). Checked: the reasoning becomes `reasoning_content` /
thinking blocks / a reasoning item, the call `tool_calls` / `tool_use` / `function_call` with
its JSON arguments, the final text the answer, with each API's stop reason."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import FakeEngine, Server, parse_sse

from freetoken.chat import ChatTokenizer
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.models.loader import load_model
from freetoken.server import create_app
from tests.chat.harmony_fixtures import write_harmony_tokenizer

REASON_CALL, REASON_FINAL = "I need the weather for Paris.", "The tool says 20 degrees."
ANSWER = "It is 20 °C in Paris."
CALL = ("<|channel|>analysis<|message|>" + REASON_CALL + "<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>')
FINAL = ("<|channel|>analysis<|message|>" + REASON_FINAL + "<|end|><|start|>assistant"
         "<|channel|>final<|message|>" + ANSWER + "<|return|>")
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
USER = "What is the weather in Paris?"

OA_TOOLS = [{"type": "function", "function": WEATHER}]
OA_CALL = {"model": "m", "max_tokens": 64, "temperature": 0, "tools": OA_TOOLS,
           "messages": [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": USER}]}
OA_RESULT = {**OA_CALL, "messages": [
    *OA_CALL["messages"],
    {"role": "assistant", "content": None, "reasoning_content": REASON_CALL, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 20}'}]}
AN_TOOLS = [{"name": WEATHER["name"], "description": WEATHER["description"],
             "input_schema": WEATHER["parameters"]}]
AN_CALL = {"model": "m", "max_tokens": 64, "temperature": 0, "tools": AN_TOOLS,
           "system": "You are terse.", "messages": [{"role": "user", "content": USER}]}
AN_RESULT = {**AN_CALL, "messages": [
    *AN_CALL["messages"],
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": REASON_CALL, "signature": "x"},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": '{"temp_c": 20}'}]}]}
RS_TOOLS = [{"type": "function", **WEATHER}]
RS_CALL = {"model": "m", "max_output_tokens": 64, "temperature": 0, "tools": RS_TOOLS,
           "instructions": "You are terse.", "input": USER}
RS_RESULT = {**RS_CALL, "input": [
    {"type": "message", "role": "user", "content": USER},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": REASON_CALL}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 20}'}]}
# (path, body, completion the model is taught)
CASES = {"oa_call": ("/v1/chat/completions", OA_CALL, CALL),
         "oa_result": ("/v1/chat/completions", OA_RESULT, FINAL),
         "an_call": ("/v1/messages", AN_CALL, CALL),
         "an_result": ("/v1/messages", AN_RESULT, FINAL),
         "rs_call": ("/v1/responses", RS_CALL, CALL),
         "rs_result": ("/v1/responses", RS_RESULT, FINAL)}


def _prompts(tok: ChatTokenizer) -> dict[str, list[int]]:
    """The ids the server renders for each case (a fake engine records them)."""
    fake = FakeEngine(tok, script=lambda req: "x")
    server = Server(create_app(fake, tok, api_key=None, served_model_names=["m"],
                               parser_family="gpt_oss"))
    out = {}
    try:
        for name, (path, body, _) in CASES.items():
            r = httpx.post(server.url + path, json=body, timeout=30)
            assert r.status_code == 200, (name, r.text)
            out[name] = list(fake.requests[-1].input_ids)
    finally:
        server.stop()
    return out


def _fit_head(d: Path, tok: ChatTokenizer, prompts: dict[str, list[int]]) -> None:
    """Fit the LM head so greedy decoding after each prompt writes its case's completion."""
    from safetensors.torch import load_file, save_file

    from tests.models.fixtures_gpt_oss import gpt_oss_reference

    ref = gpt_oss_reference(d)
    feats, targets = [], []
    for name, ids in prompts.items():
        completion = tok.encode(CASES[name][2])
        seq = ids + completion
        with torch.no_grad():
            h = ref.model(torch.tensor([seq])).last_hidden_state[0]  # [T, H], after the norm
        feats.append(h[len(ids) - 1:len(seq) - 1])  # the positions that predict the completion
        targets.append(torch.tensor(completion))
    F, y = torch.cat(feats), torch.cat(targets)  # [N, H], [N]
    classes = torch.unique(y)  # the tokens the completions use; every other row stays 0
    yi = torch.searchsorted(classes, y)
    W = torch.zeros(len(classes), F.shape[1], requires_grad=True)
    opt = torch.optim.Adam([W], lr=0.05)
    for _ in range(1500):
        logits = torch.cat([F @ W.T, torch.zeros(len(F), 1)], 1)  # the zero rows' logit 0
        loss = torch.nn.functional.cross_entropy(logits, yi)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = F @ W.T
        right = logits.gather(1, yi[:, None])[:, 0]
        others = logits.scatter(1, yi[:, None], float("-inf")).amax(1).clamp_min(0.0)
        assert (right - others).min() > 1.0, "the completions do not fit the tiny model"
    f = d / "model.safetensors"
    state = load_file(str(f))
    head = torch.zeros_like(state["lm_head.weight"])
    head[classes] = W.detach().to(head.dtype)
    state["lm_head.weight"] = head
    save_file(state, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import transformers as tf

    from tests.models.fixtures_gpt_oss import CONFIG, _randomise

    d = tmp_path_factory.mktemp("tiny-gpt-oss-chat")
    torch.manual_seed(0)
    cfg = {**CONFIG, "vocab_size": 151680, "eos_token_id": None, "bos_token_id": None,
           "pad_token_id": None}
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**cfg)).eval()
    _randomise(model)
    model.save_pretrained(d)
    write_harmony_tokenizer(d)
    tok = ChatTokenizer.from_dir(d)
    assert tok.harmony is not None
    _fit_head(d, tok, _prompts(tok))
    core = EngineCore(load_model(d, dtype=torch.float32, progress=False), tok.eos_token_ids,
                      kv_tokens=4096, state_slots=4, max_running=4, chunk_tokens=512,
                      decode_runner=False)
    engine = AsyncEngine(core, d, "tiny-gpt-oss")
    server = Server(create_app(engine, tok, api_key=None, served_model_names=["m"],
                               parser_family="gpt_oss"))
    yield server
    server.stop()
    engine.shutdown()


def _post(server, name: str, stream: bool = False):
    path, body, _ = CASES[name]
    body = {**body, "stream": stream}
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return parse_sse(r.text) if stream else r.json()


def test_openai_chat(served) -> None:
    r = _post(served, "oa_call")
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["reasoning_content"] == REASON_CALL
    (call,) = ch["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    r = _post(served, "oa_result")
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["message"]["content"] == ANSWER
    assert ch["message"]["reasoning_content"] == REASON_FINAL
    assert not ch["message"].get("tool_calls")


def test_openai_chat_streamed(served) -> None:
    events = [e for _, e in _post(served, "oa_call", stream=True) if isinstance(e, dict)]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == REASON_CALL
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    args = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(args) == {"city": "Paris"}
    finish = [e["choices"][0].get("finish_reason") for e in events if e.get("choices")]
    assert "tool_calls" in finish
    events = [e for _, e in _post(served, "oa_result", stream=True) if isinstance(e, dict)]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_anthropic_messages(served) -> None:
    r = _post(served, "an_call")
    assert r["stop_reason"] == "tool_use"
    kinds = [b["type"] for b in r["content"]]
    assert kinds == ["thinking", "tool_use"], r["content"]
    assert r["content"][0]["thinking"] == REASON_CALL
    assert r["content"][1]["name"] == "get_weather"
    assert r["content"][1]["input"] == {"city": "Paris"}
    r = _post(served, "an_result")
    assert r["stop_reason"] == "end_turn"
    assert [b["type"] for b in r["content"]] == ["thinking", "text"]
    assert r["content"][1]["text"] == ANSWER


def test_anthropic_messages_streamed(served) -> None:
    events = [e for _, e in _post(served, "an_call", stream=True) if isinstance(e, dict)]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    thinking = "".join(e["delta"].get("thinking", "") for e in events
                       if e["type"] == "content_block_delta")
    args = "".join(e["delta"].get("partial_json", "") for e in events
                   if e["type"] == "content_block_delta")
    assert thinking == REASON_CALL and json.loads(args) == {"city": "Paris"}
    stop = [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"]
    assert stop == ["tool_use"]


def test_responses_api(served) -> None:
    r = _post(served, "rs_call")
    kinds = [it["type"] for it in r["output"]]
    assert kinds == ["reasoning", "function_call"], r["output"]
    assert r["output"][0]["summary"][0]["text"] == REASON_CALL
    assert r["output"][1]["name"] == "get_weather"
    assert json.loads(r["output"][1]["arguments"]) == {"city": "Paris"}
    r = _post(served, "rs_result")
    kinds = [it["type"] for it in r["output"]]
    assert kinds == ["reasoning", "message"], r["output"]
    assert r["output"][1]["content"][0]["text"] == ANSWER
    events = [e for _, e in _post(served, "rs_call", stream=True) if isinstance(e, dict)]
    done = [e["item"]["type"] for e in events if e.get("type") == "response.output_item.done"]
    assert done == ["reasoning", "function_call"]
