"""Tiny random transformers checkpoints, one per family and config spelling, for tests.

`build_tiny_hf(kind, out_dir)` seeds torch, builds the transformers model from a tiny config,
randomises the norm weights (so zero-centred `(1 + w)` and plain `w` norms cannot be confused),
casts to `dtype` and `save_pretrained`s it. Spelling variants rewrite `config.json` afterwards to
the form published checkpoints use. `hf_reference(dir)` loads the transformers model back in fp32
eval mode: the oracle for weights and logits.
"""
from __future__ import annotations

import sys

# transformers picks fla / causal_conv1d kernels when importable; they need a GPU.
sys.modules["fla"] = None  # type: ignore[assignment]
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import json
from pathlib import Path
from typing import Any

import torch

from tests.models.fixtures_deepseek import KINDS as DEEPSEEK_KINDS
from tests.models.fixtures_deepseek import make_deepseek, rewrite_deepseek_config

KINDS = (
    "qwen3_moe",
    "qwen3_moe_dense_layers",
    "qwen3_moe_num_local_experts",
    "qwen3_next",
    "qwen3_next_old_spelling",
    "qwen3_5_moe",
    "qwen3_5_moe_vl",
    *DEEPSEEK_KINDS,
)

# MODEL_FACTS §1 sizes: small enough that a forward pass takes milliseconds.
_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
_LINEAR: dict[str, Any] = {
    "shared_expert_intermediate_size": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
}


def _make_model(kind: str) -> torch.nn.Module:
    import transformers as tf

    if kind.startswith(("deepseek", "kimi", "glm")):
        return make_deepseek(kind)
    if kind.startswith("qwen3_moe"):
        kw: dict[str, Any] = dict(_COMMON, intermediate_size=128, norm_topk_prob=True)
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
        if kind == "qwen3_moe_dense_layers":
            # step 2 → layers 1,3,5 sparse; mlp_only_layers drops 3 → MoE at 1 and 5 only
            kw.update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3],
                      attention_bias=True, norm_topk_prob=False)
        if kind == "qwen3_moe_num_local_experts":
            kw.update(tie_word_embeddings=True)
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**kw))
    if kind.startswith("qwen3_next"):
        kw = dict(_COMMON, **_LINEAR, intermediate_size=128, norm_topk_prob=True)
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**kw))
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**_COMMON, **_LINEAR))
    if kind == "qwen3_5_moe_vl":
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                  "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
                  "out_hidden_size": 64, "num_position_embeddings": 16}
        text = dict(_COMMON, **_LINEAR)
        cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=500,
                                  video_token_id=501, vision_start_token_id=502,
                                  vision_end_token_id=503, tie_word_embeddings=False)
        return tf.Qwen3_5MoeForConditionalGeneration(cfg)
    raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(KINDS)}")


@torch.no_grad()
def _randomise_norms(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Give every norm weight (and dt_bias) a distinct random value around its init.

    Weights initialised to ones (plain norms) become 1 + noise; zeros (zero-centred norms)
    become noise. A loader that applied the wrong convention would then be visibly wrong.
    """
    for name, p in model.named_parameters():
        if p.dim() != 1 or not (name.endswith(("norm.weight", "dt_bias"))):
            continue
        noise = torch.randn(p.shape, generator=gen) * 0.1
        p.copy_(noise + (1.0 if bool((p == 1).all()) else 0.0))


def _rewrite_config(out_dir: Path, kind: str) -> None:
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    if kind == "qwen3_moe":
        # published Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts
        if "num_local_experts" in cfg:
            cfg["num_experts"] = cfg.pop("num_local_experts")
    elif kind == "qwen3_next_old_spelling":
        layer_types = cfg.pop("layer_types")
        interval = layer_types.index("full_attention") + 1
        assert layer_types == [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(len(layer_types))
        ]
        cfg["full_attention_interval"] = interval
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope["rope_theta"]
        cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
        cfg["rope_scaling"] = None
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg = rewrite_deepseek_config(cfg, kind)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_tiny_hf(
    kind: str,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | int | None = None,
) -> Path:
    """Build and save a tiny random transformers checkpoint of `kind` into `out_dir`.

    Deterministic for a given (kind, dtype, seed). `max_shard_size` (e.g. "20KB") forces a
    sharded save with `model.safetensors.index.json`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = _make_model(kind)
    _randomise_norms(model, torch.Generator().manual_seed(seed + 1))
    model = model.to(dtype).eval()
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    _rewrite_config(out, kind)
    return out


def hf_reference(model_dir: str | Path) -> torch.nn.Module:
    """The transformers model saved in `model_dir`, in fp32 eval mode (the test oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()
