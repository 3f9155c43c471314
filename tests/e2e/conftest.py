"""A real `ft serve` stack (AsyncEngine + EngineCore + starlette app on uvicorn) over a tiny
random qwen3_5_moe with the real Qwen3 tokenizer, shared by the end-to-end tests."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import Server

from freetoken.chat import ChatTokenizer
from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.core import EngineCore
from freetoken.models.demo import tokenizer_source_dir
from freetoken.models.loader import load_model
from freetoken.server import create_app


def build_tiny_chat_model(out: Path) -> Path:
    """Tiny hybrid MoE (hidden 64, 4 layers: 3 linear + 1 full) over the real Qwen3 vocab."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=151680, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=262144, eos_token_id=[151645, 151643])
    Qwen3_5MoeForCausalLM(cfg).eval().save_pretrained(out)
    src = tokenizer_source_dir()
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return out


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _serve(tiny_chat_dir: Path, decode_runner: bool):
    model = load_model(tiny_chat_dir, dtype=torch.float32, progress=False)
    tok = ChatTokenizer.from_dir(tiny_chat_dir)
    core = EngineCore(model, tok.eos_token_ids, kv_tokens=280000, state_slots=48, max_running=4,
                      chunk_tokens=1024, max_context=262144, decode_runner=decode_runner)
    engine = AsyncEngine(core, tiny_chat_dir, "tiny")
    server = Server(create_app(engine, tok, api_key=None, served_model_names=["tiny"],
                               parser_family="qwen3_5_moe"))
    return server, engine


@pytest.fixture(scope="session")
def live(tiny_chat_dir: Path):
    """(server, engine): a real engine behind the real app on a free port."""
    server, engine = _serve(tiny_chat_dir, False)
    yield server, engine
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="session")
def live_overlap(tiny_chat_dir: Path):
    """`live` with decode steps through the decode runner, as on CUDA: each decode step is
    launched before the previous one's tokens are post-processed (EngineCore's overlap)."""
    server, engine = _serve(tiny_chat_dir, True)
    yield server, engine
    server.stop()
    engine.shutdown()
