from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    return qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def tok(qwen_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="session")
def hf_tok(qwen_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen_dir))


@pytest.fixture(scope="session")
def trace_reqs() -> list[tuple[str, dict[str, Any]]]:
    """(file stem + seq, record) of every recorded harness request with a JSON body."""
    out = []
    for f in sorted(TRACES.glob("*/*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if isinstance(rec.get("body"), dict) and "messages" in rec["body"]:
                out.append((f"{f.stem}#{rec['seq']}", rec))
    return out
