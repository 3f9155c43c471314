"""Tiny random gpt-oss checkpoints (transformers' GptOssForCausalLM) for the family tests.

`build_gpt_oss(out_dir, mxfp4=False)` seeds torch, builds the model from a tiny config with
sliding layers whose window (6) is shorter than the test prompts, randomises every weight with
scales that make the tiny model exercise what matters (gate / up values past the SwiGLU limit,
sinks that take a real share of the softmax, expert and router biases), and saves it:

- dense: transformers' `save_pretrained` (fp32, input-major fused experts);
- MXFP4: the same weights as released checkpoints store them: each expert matrix rounded to
  BF16, quantized to MXFP4 (`freetoken.kernels.quant.quantize_mxfp4`, rows in the checkpoint's
  interleaved order) as `*_blocks` [E, R, C/32, 16] / `*_scales` [E, R, C/32], and
  `quantization_config: {quant_method: mxfp4}`.

`gpt_oss_reference(dir)` is the oracle: transformers' model in fp32 eval mode with eager
attention; for an MXFP4 directory its experts are transformers' own dequantization of the blocks
(`integrations.mxfp4.convert_moe_packed_tensors`), so our reader and kernels are held to
another implementation of the format.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken.kernels.quant import quantize_mxfp4

CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
    "num_experts_per_tok": 2, "sliding_window": 6, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "attention_bias": True,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 64},
}


def _randomise(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        std = 0.15
        if "experts.gate_up_proj" in name and not name.endswith("bias"):
            std = 1.2  # gate / up past ±7 on a share of entries: the clamps are exercised
        elif name.endswith(("_bias", "router.bias", "sinks")):
            std = 1.0
        elif "layernorm" in name or name.endswith("norm.weight"):
            p.data = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
            continue
        p.data = std * torch.randn(p.shape, generator=g)


def build_gpt_oss(out_dir: Path, mxfp4: bool = False) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**CONFIG)).eval()
    _randomise(model)
    model.save_pretrained(out_dir)
    if mxfp4:
        to_mxfp4(out_dir)
    return out_dir


def to_mxfp4(d: Path) -> None:
    """Rewrite a dense checkpoint in place as the released MXFP4 one (module docstring)."""
    f = d / "model.safetensors"
    state = load_file(str(f))
    out = {}
    for name, w in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows_major = w.transpose(1, 2).to(torch.bfloat16)  # [E, R, C]: the stored rows
            qb = quantize_mxfp4(rows_major)
            E, R, C = rows_major.shape
            out[name + "_blocks"] = qb.data.reshape(E, R, C // 32, 16).contiguous()
            out[name + "_scales"] = qb.scale.contiguous()
        else:
            out[name] = w
    save_file(out, str(f), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg))


def gpt_oss_reference(d: Path) -> torch.nn.Module:
    """transformers' GptOssForCausalLM on `d`'s weights (MXFP4 experts dequantized by
    transformers' own convert_moe_packed_tensors), fp32, eager attention."""
    import transformers as tf
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    raw = json.loads((d / "config.json").read_text())
    raw.pop("quantization_config", None)
    cfg = tf.GptOssConfig(**{k: v for k, v in raw.items()
                             if k not in ("architectures", "transformers_version", "model_type")})
    cfg._attn_implementation = "eager"
    model = tf.GptOssForCausalLM(cfg).eval()
    state = load_file(str(d / "model.safetensors"))
    dense = {}
    for name, t in state.items():
        if name.endswith("_blocks"):
            base = name[:-len("_blocks")]
            dense[base] = convert_moe_packed_tensors(t, state[base + "_scales"],
                                                     dtype=torch.float32)
        elif not name.endswith("_scales"):
            dense[name] = t.float()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and all("rotary" in n for n in missing), (missing, unexpected)
    return model
