"""The random-weight demo checkpoint ("demo-random"): deterministic, a valid qwen3_5_moe for
transformers and for our reader. The trained demo: tests/models/test_demo_trained.py."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from freetoken.checkpoint.safetensors_reader import load_checkpoint
from freetoken.models.demo import (
    DEMO_RANDOM_NAME,
    ModelPathError,
    random_demo_dir,
    resolve_model_path,
    tokenizer_source_dir,
)
from freetoken.types.model_config import load_config


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_demo_dir(tmp_path_factory.mktemp("cache_a"))


def test_build_is_atomic_and_cached(demo_dir: Path) -> None:
    assert demo_dir.name == DEMO_RANDOM_NAME
    assert [p.name for p in demo_dir.parent.iterdir()] == [DEMO_RANDOM_NAME]  # no temp dir left
    mtime = (demo_dir / "model.safetensors").stat().st_mtime_ns
    assert random_demo_dir(demo_dir.parent) == demo_dir
    assert (demo_dir / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt


def test_build_is_byte_identical(demo_dir: Path, tmp_path: Path) -> None:
    other = random_demo_dir(tmp_path)
    assert other != demo_dir
    assert _sha256(other / "model.safetensors") == _sha256(demo_dir / "model.safetensors")


def test_config_parses_as_transformers_reads_it(demo_dir: Path) -> None:
    """Our parse of the demo's config.json against transformers' own (the oracle), field by
    field; plus what the demo promises: a hybrid qwen3_5_moe over the real Qwen3 vocabulary."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(demo_dir).get_text_config()
    cfg = load_config(demo_dir)
    assert cfg.model_type == "qwen3_5_moe" and cfg.has_linear_attention
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.full_attention_layers == [i for i, t in enumerate(hf.layer_types)
                                         if t == "full_attention"]
    pairs = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
             "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "num_experts": "num_experts", "top_k": "num_experts_per_tok",
             "moe_intermediate_size": "moe_intermediate_size",
             "shared_expert_intermediate_size": "shared_expert_intermediate_size",
             "linear_num_key_heads": "linear_num_key_heads",
             "linear_num_value_heads": "linear_num_value_heads",
             "linear_key_head_dim": "linear_key_head_dim",
             "linear_value_head_dim": "linear_value_head_dim",
             "linear_conv_kernel": "linear_conv_kernel_dim", "rms_norm_eps": "rms_norm_eps",
             "max_position_embeddings": "max_position_embeddings",
             "tie_word_embeddings": "tie_word_embeddings"}
    for ours, theirs in pairs.items():
        assert getattr(cfg, ours) == getattr(hf, theirs), ours
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
    assert set(cfg.eos_token_ids) == set(hf.eos_token_id)
    # qwen3_5's router always renormalises its top-k (transformers leaves the flag unset)
    assert cfg.norm_topk_prob
    assert cfg.vocab_size % 64 == 0 and 151669 <= cfg.vocab_size < 151669 + 64
    assert cfg.weight_prefix == "model." and not cfg.linear_fused_qkvz
    gen = json.loads((demo_dir / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == set(hf.eos_token_id)


def test_tokenizer_files_are_the_real_qwen3_ones(demo_dir: Path) -> None:
    from tokenizers import Tokenizer

    src = tokenizer_source_dir()
    for f in src.iterdir():
        assert (demo_dir / f.name).read_bytes() == f.read_bytes(), f.name
    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert tok.token_to_id("<|im_end|>") == 151645 and tok.token_to_id("<|endoftext|>") == 151643
    assert tok.get_vocab_size(with_added_tokens=True) <= load_config(demo_dir).vocab_size
    tcfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"] and "tool_call" in tcfg["chat_template"]


def test_size_bound(demo_dir: Path) -> None:
    total = sum(f.stat().st_size for f in demo_dir.iterdir())
    assert total < 300e6
    with open(demo_dir / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes == {"BF16"}


def test_transformers_loads_it_exactly(demo_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        demo_dir, dtype=torch.bfloat16, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    # the reader yields exactly transformers' parameters, values included
    ours = load_checkpoint(demo_dir, load_config(demo_dir), torch.bfloat16, progress=False)
    params = dict(model.named_parameters())
    assert sorted(ours) == sorted(params)
    for name in (
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.2.linear_attn.A_log",
        "lm_head.weight",
    ):
        assert torch.equal(ours[name], params[name]), name
    a_log = ours["model.layers.2.linear_attn.A_log"].float()
    assert bool(((a_log >= 0) & (a_log <= torch.log(torch.tensor(16.0)) + 1e-2)).all())


def test_resolve_model_path(
    tmp_path: Path, demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from freetoken.models.demo_trained import trained_name

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # prebuilt cache: link the module's build instead of building again
    models = tmp_path / "xdg" / "freetoken" / "models"
    models.mkdir(parents=True)
    (models / DEMO_RANDOM_NAME).symlink_to(demo_dir)
    assert resolve_model_path("demo-random") == models / DEMO_RANDOM_NAME
    (models / trained_name()).mkdir()  # "demo" is the trained one, under its own name
    assert resolve_model_path("demo") == models / trained_name()
    assert resolve_model_path(None) == resolve_model_path("demo")
    assert resolve_model_path(str(demo_dir)) == demo_dir
    with pytest.raises(ModelPathError, match="neither 'demo', 'demo-random' nor a checkpoint"):
        resolve_model_path("Qwen/Qwen3-30B-A3B")
    with pytest.raises(ModelPathError, match="no config.json"):
        resolve_model_path(tmp_path)
