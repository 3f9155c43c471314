"""Fixtures: the real Qwen3 tokenizer, a FakeEngine, and one uvicorn server per session
(the engine is reset before each test)."""
from __future__ import annotations

import pytest
from server_helpers import API_KEY, FakeEngine, Server

from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
from freetoken.server import create_app


@pytest.fixture(scope="session")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen3_tokenizer_dir())


@pytest.fixture(scope="session")
def engine(tok: ChatTokenizer) -> FakeEngine:
    return FakeEngine(tok)


@pytest.fixture(scope="session")
def _server(engine: FakeEngine, tok: ChatTokenizer) -> Server:
    app = create_app(engine, tok, api_key=API_KEY, served_model_names=["fake-qwen3", "alias"])
    s = Server(app)
    yield s
    s.stop()


@pytest.fixture()
def server(_server: Server, engine: FakeEngine) -> Server:
    engine.reset()
    return _server


@pytest.fixture()
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
