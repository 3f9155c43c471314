"""The server renders a model whose checkpoint declares a prompt compaction (the trained demo,
`demo_manifest.json` `prompt_compaction`) its compacted request, on /v1/chat/completions and
/v1/messages alike, and logs one `ft.demo:` line a request; a checkpoint that declares none gets
the request as sent. The engine's recorded prompt ids are checked against the tokenizer's own
rendering of the compacted (or the whole) request."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest
from server_helpers import API_KEY, FakeEngine, Server

from freetoken.chat import (
    ChatTokenizer,
    anthropic_to_template,
    openai_to_template,
    qwen3_tokenizer_dir,
)
from freetoken.chat import compaction as cp
from freetoken.models import demo_data as dd
from freetoken.server import create_app

CWD = "/srv/ember-atlas"


@pytest.fixture(scope="module", params=sorted(cp.COMPACTIONS))
def compacting(request, tmp_path_factory: pytest.TempPathFactory):
    """(engine, tokenizer, server, version) of a checkpoint that declares each compaction
    (demo-v1: the shipped v5 weights; demo-v2: data v6's)."""
    d = tmp_path_factory.mktemp("ckpt") / "demo"
    shutil.copytree(qwen3_tokenizer_dir(), d)
    (d / "demo_manifest.json").write_text(json.dumps({"prompt_compaction": request.param}))
    tok = ChatTokenizer.from_dir(d)
    assert tok.compaction is not None
    engine = FakeEngine(tok)
    server = Server(create_app(engine, tok, api_key=API_KEY, served_model_names=["demo"]))
    yield engine, tok, server, request.param
    server.stop()


def _post(server: Server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text[:2000]
    return r.json()


def _bodies() -> dict[str, tuple[str, dict, object]]:
    """(path, request body, its template input) of OpenCode's and Claude Code's first request."""
    oc = dd.base_request(dd.HARNESSES["opencode"], "ls src", CWD)
    cc = dd.base_request(dd.HARNESSES["claude_code"], "what does README.md say", CWD)
    return {"openai": ("/v1/chat/completions", {"model": "demo", "max_tokens": 8, **oc},
                       openai_to_template(oc)),
            "anthropic": ("/v1/messages", {"model": "demo", "max_tokens": 8, **cc},
                          anthropic_to_template(cc))}


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_the_declared_compaction_is_what_the_engine_gets(api: str, compacting, caplog) -> None:
    engine, tok, server, version = compacting
    path, body, ti = _bodies()[api]
    engine.reset()
    demo_log = logging.getLogger("ft.demo")  # its own handler: `ft` may not propagate
    demo_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="ft.demo"):
            _post(server, path, body)
    finally:
        demo_log.removeHandler(caplog.handler)
    got = engine.requests[-1].input_ids
    msgs, tools = cp.COMPACTIONS[version](ti.messages, ti.tools)
    want = tok.apply(msgs, tools, ti.enable_thinking, reasoning_effort=ti.reasoning_effort)
    whole = tok.apply(ti.messages, ti.tools, ti.enable_thinking)
    assert got == want.input_ids
    assert len(got) < len(whole.input_ids) / 3
    records = {id(r): r for r in caplog.records if r.name == "ft.demo"}  # (seen twice when
    lines = [r.getMessage() for r in records.values()]  # `ft` propagates to the root too)
    assert len(lines) == 1 and lines[0].startswith(f"prompt_compaction version={version} ")


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_model_that_declares_none_gets_the_request_as_sent(api: str, server: Server,
                                                              engine: FakeEngine,
                                                              tok: ChatTokenizer) -> None:
    path, body, ti = _bodies()[api]
    r = httpx.post(server.url + path, json={**body, "model": "fake-qwen3"}, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text[:500]
    assert tok.compaction is None
    want = tok.apply(ti.messages, ti.tools, ti.enable_thinking)
    assert engine.requests[-1].input_ids == want.input_ids


def test_the_shipped_manifest_declares_what_its_data_was_cut_with(tmp_path: Path) -> None:
    """`demo_trained.ship` copies the data's `prompt_compaction` into the manifest (so the built
    checkpoint's `demo_manifest.json` turns it on) and writes none for data that had none."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from freetoken.models.demo_trained import ship

    run = tmp_path / "run"
    run.mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(run / "compact.safetensors"))
    np.save(run / "used.npy", np.array([1, 5], dtype=np.int64))
    (run / "loss.json").write_text(json.dumps([{"step": 1, "loss": 2.0, "harness": "mini_tool"}]))
    for data, want in (({"data_version": 5, "prompt_compaction": cp.VERSION}, cp.VERSION),
                       ({"data_version": 6, "prompt_compaction": cp.VERSION_V2}, cp.VERSION_V2),
                       ({"data_version": 4}, None)):
        (run / "train_meta.json").write_text(json.dumps({"data": data}))
        man = ship(run, tmp_path / f"w{data['data_version']}")
        assert man.get("prompt_compaction") == want
