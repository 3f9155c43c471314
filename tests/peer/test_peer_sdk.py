"""`ft agent-proxy --upstream URL` (default flags) in front of a real llama.cpp server
(llama-cpp-python's, built from its PyPI sdist by scripts/install_peer.sh into its own venv) on a
tiny random Qwen3 GGUF: the GGUF against transformers (the oracle for the peer itself), the
OpenAI and Anthropic SDKs streamed and not (the Anthropic ones translated to the peer's chat
API, which has no /v1/messages), the default output cap, and the limits the proxy discovers
from the peer's own dialect. Skipped with the reason when llama_cpp is not importable from
the peer venv (CI: never built there)."""
from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from peer_stack import ALIAS, PEER_SKIP, metrics, start_peer, start_proxy, tiny_model
from server_helpers import parse_sse

pytestmark = [pytest.mark.slow, pytest.mark.skipif(PEER_SKIP is not None,
                                                   reason=PEER_SKIP or "")]
MSGS = [{"role": "user", "content": "Say hello in three words."}]
GREEDY = {"temperature": 0}  # sent raw: this Anthropic SDK has no `temperature` argument


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    hf, gguf = tiny_model()
    d = tmp_path_factory.mktemp("peer")
    peer = start_peer(gguf, d)
    proxy = start_proxy(peer.url, d)
    yield hf, peer, proxy
    proxy.stop()
    peer.stop()


def test_gguf_matches_transformers(stack) -> None:
    """The peer runs the checkpoint it was given: llama.cpp's tokenizer and greedy tokens on the
    GGUF equal transformers' on the safetensors checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from freetoken.chat import ChatTokenizer

    hf, peer, _ = stack
    text = "def add(a, b):\n    return a + b  # 加法\n"
    tok = ChatTokenizer.from_dir(hf)
    ids = tok.encode(text)
    got = httpx.post(peer.url + "/extras/tokenize", json={"input": text}, timeout=30).json()
    assert got["tokens"] == ids
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    want = out[0, len(ids):].tolist()
    r = httpx.post(peer.url + "/v1/completions", timeout=60, json={
        "prompt": text, "max_tokens": len(want), "temperature": 0.0,
        "repeat_penalty": 1.0}).json()
    # llama-cpp-python drops the bytes of a split UTF-8 character (errors="ignore") where the
    # HF tokenizer writes U+FFFD
    assert r["choices"][0]["text"] == tok.decode(want).replace("\ufffd", ""), (want, r)


def test_openai_sdk_streamed_and_not(stack) -> None:
    _, _, proxy = stack
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=8, extra_body=GREEDY)
    text = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 5
    chunks = list(c.chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and
              ch.choices[0].finish_reason]
    assert finals == [r.choices[0].finish_reason]


def test_anthropic_sdk_streamed_and_not_each_stream_once(stack) -> None:
    _, _, proxy = stack
    c = anthropic.Anthropic(base_url=proxy.url, api_key="none", max_retries=0)
    m = c.messages.create(model=ALIAS, messages=MSGS, max_tokens=8, extra_body=GREEDY)
    text = "".join(b.text for b in m.content if b.type == "text")
    assert m.stop_reason in ("max_tokens", "end_turn") and m.usage.input_tokens > 5
    with c.messages.stream(model=ALIAS, messages=MSGS, max_tokens=8,
                           extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert "".join(b.text for b in final.content if b.type == "text") == text
    # the wire: one message_start ... message_stop, nothing after (issue 28: a translated
    # stream was emitted twice)
    raw = httpx.post(proxy.url + "/v1/messages", timeout=60, json={
        "model": ALIAS, "messages": MSGS, "max_tokens": 8, "temperature": 0, "stream": True})
    evs = [e for e, _ in parse_sse(raw.text) if e != "#comment" and e != "ping"]
    assert evs[0] == "message_start" and evs[-1] == "message_stop"
    assert evs.count("message_start") == 1 and evs.count("message_stop") == 1
    assert evs.count("message_delta") == 1


def test_output_cap_by_default(stack) -> None:
    """Claude Code asks for 64,000 tokens; the proxy sends its default cap (8192 with
    --upstream) instead. The client goes away after the first token (a 8192-token reply of a
    random model is not worth waiting for); the record says what was sent."""
    _, _, proxy = stack
    n = len(metrics(proxy))
    with httpx.stream("POST", proxy.url + "/v1/messages", timeout=60, json={
            "model": ALIAS, "messages": MSGS, "max_tokens": 64000, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                break
    t0 = time.time()
    while len(metrics(proxy)) == n and time.time() - t0 < 30:
        time.sleep(0.1)
    rec = metrics(proxy)[-1]
    assert rec["max_tokens_requested"] == 64000 and rec["max_tokens_sent"] == 8192, rec
    assert rec["disconnected"] is True  # (`capped` means a reply that reached the cap)


def test_limits_and_surfaces_from_the_peers_dialect(stack, tmp_path) -> None:
    """llama-cpp-python's server has no /v1/messages (the proxy translates, never 404s) and its
    /v1/models names the model but no limits; the proxy reports what it found and `ft launch`
    writes the model and the cap into the harness config."""
    _, peer, proxy = stack
    assert httpx.post(peer.url + "/v1/messages", json={}).status_code == 404
    st = httpx.get(proxy.url + "/proxy/stats", timeout=10).json()
    up = st["upstream_limits"]
    assert up["surfaces"] == {"anthropic": False} and up["model"] == ALIAS, up
    from freetoken.cli import main

    assert main(["launch", "opencode", "--proxy", proxy.url, "--write", str(tmp_path)]) == 0
    cfg = json.loads((tmp_path / "opencode.json").read_text())
    models = next(iter(cfg["provider"].values()))["models"]
    assert ALIAS in models, cfg
    assert models[ALIAS]["limit"]["output"] <= 8192, models
