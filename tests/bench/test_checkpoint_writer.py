"""`ft bench checkpoint`: a random checkpoint in the released layout that the real loader and
tokenizer take like a downloaded one."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from freetoken.chat import ChatTokenizer
from freetoken.checkpoint.ftw import is_ftw
from freetoken.checkpoint.layout import expected_tensors
from freetoken.cli import main
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.model_config import load_config


def test_safetensors_checkpoint_loads_and_every_id_decodes(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    assert main(["bench", "checkpoint", "--shape", "tiny-qwen3.5-moe", "--layers", "2",
                 "--shard-gb", "0.01", "--no-progress", str(out)]) == 0
    raw = json.loads((out / "config.json").read_text())
    # the released Qwen3.6 layout: the multimodal wrapper, text model nested, prefixed tensors
    assert raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert raw["text_config"]["num_hidden_layers"] == 2
    cfg = load_config(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected_tensors(cfg))
    assert len(set(index["weight_map"].values())) > 1  # sharded
    name = "model.language_model.layers.0.mlp.experts.7.down_proj.weight"
    with safe_open(str(out / index["weight_map"][name]), framework="pt") as f:
        t = f.get_tensor(name)
    assert t.dtype == torch.bfloat16 and list(t.shape) == [64, 32]
    assert 0.01 < float(t.float().std()) < 0.03
    model = load_model(out, progress=False)
    tok = ChatTokenizer.from_dir(out)
    assert tok.vocab_size == cfg.vocab_size == 151680
    ids = generate(model, tok.encode("hello"), SamplingParams(max_tokens=6, temperature=0.0,
                                                              ignore_eos=True), []).token_ids
    assert len(ids) == 6
    assert tok.decode([cfg.vocab_size - 1]) == f"[PAD{cfg.vocab_size - 1}]"
    # the pads are vocabulary entries, not added tokens (96k added tokens took 8.3 s to load,
    # and the input could spell them): the text encodes as with the real tokenizer
    from freetoken.chat import qwen3_tokenizer_dir

    real = ChatTokenizer.from_dir(qwen3_tokenizer_dir())
    text = "hi [PAD151700] <|im_start|>user\nx<|im_end|><think>y</think>"
    assert tok.encode(text) == real.encode(text)
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    assert len(added) == len(json.loads((qwen3_tokenizer_dir() / "tokenizer.json").read_text())
                                ["added_tokens"])


def test_ftw_checkpoint_is_written_directly(tmp_path: Path) -> None:
    out = tmp_path / "ftw"
    assert main(["bench", "checkpoint", "--shape", "tiny-qwen3.5-moe", "--layers", "1",
                 "--format", "ftw", "--no-progress", str(out)]) == 0
    assert is_ftw(out) and not list(out.glob("*.safetensors"))
    model = load_model(out, dtype=torch.bfloat16, progress=False)
    ids = generate(model, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                    ignore_eos=True), []).token_ids
    assert len(ids) == 4


def test_fp8_checkpoint_as_released_loads_with_fp8_experts(tmp_path: Path) -> None:
    # issue 25: `ft bench checkpoint` for an FP8 shape writes e4m3 linears beside their
    # weight_scale_inv (quantization_config at the top level, as Qwen3.6-FP8), which the real
    # loader takes with its routed experts kept FP8
    from freetoken.kernels.quant import QuantBank

    out = tmp_path / "fp8"
    assert main(["bench", "checkpoint", "--shape", "tiny-qwen3.5-moe-fp8", "--layers", "2",
                 "--shard-gb", "0.01", "--no-progress", str(out)]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"
    with safe_open(str(out / index["weight_map"][name]), framework="pt") as f:
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn
        assert list(f.get_tensor(name + "_scale_inv").shape) == [1, 1]
    gate = "model.language_model.layers.1.mlp.gate.weight"
    with safe_open(str(out / index["weight_map"][gate]), framework="pt") as f:
        assert f.get_tensor(gate).dtype == torch.bfloat16  # the router stays BF16
    model = load_model(out, progress=False)
    assert isinstance(model.moe_blocks()[0].experts.gate_up_proj, QuantBank)
    ids = generate(model, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                    ignore_eos=True), []).token_ids
    assert len(ids) == 4
