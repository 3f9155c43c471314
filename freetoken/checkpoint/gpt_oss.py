"""gpt-oss checkpoints (`gpt_oss`): the tensors on disk and their runtime form.

On disk (transformers 5's `save_pretrained` and the released checkpoints; prefix `model.`):

    layers.{i}.input_layernorm.weight / post_attention_layernorm.weight   [H]
    layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}   [Hq·d | Hk·d, H]; o_proj [H, Hq·d] + bias
    layers.{i}.self_attn.sinks                         [Hq]
    layers.{i}.mlp.router.weight [E, H], router.bias [E]
    layers.{i}.mlp.experts.gate_up_proj_bias [E, 2I]   gate / up interleaved (even: gate)
    layers.{i}.mlp.experts.down_proj_bias    [E, H]
    dense (bf16 / fp32): mlp.experts.gate_up_proj [E, H, 2I] (input-major, interleaved columns),
                         mlp.experts.down_proj    [E, I, H]
    MXFP4 (released):    mlp.experts.gate_up_proj_blocks uint8 [E, 2I, H/32, 16] + _scales
                         uint8 [E, 2I, H/32]; down_proj_blocks [E, H, I/32, 16] + _scales
                         [E, H, I/32] (rows interleaved as above; checkpoint/mxfp4.py)
    embed_tokens.weight [V, H], norm.weight [H], lm_head.weight [V, H]

At runtime the experts are QwenMoE's banks: `mlp.experts.gate_up_proj` [E, 2I, H] rows
[gate | up] and `mlp.experts.down_proj` [E, H, I] (dense tensors in `dtype`, or MXFP4
`QuantBank`s kept as stored), and their biases `mlp.gate_up_bias` [E, 2I] (rows regrouped to
[gate | up]) and `mlp.down_bias` [E, H] (freetoken/models/gpt_oss.py).

Legend: H hidden, E experts, I expert intermediate, Hq / Hk heads, d head_dim, V vocab.
"""
from __future__ import annotations

import torch
from torch import Tensor

from freetoken.checkpoint.layout_parts import Shape
from freetoken.checkpoint.mxfp4 import mxfp4_bank
from freetoken.types.model_config import ModelConfig


def is_mxfp4(cfg: ModelConfig) -> bool:
    fmt = cfg.expert_format
    return getattr(fmt, "name", None) == "mxfp4"


def expected_tensors_gpt_oss(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor name on disk and its shape, in a stable order (module docstring)."""
    pre, H, E, I = cfg.weight_prefix, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, Shape] = {f"{pre}embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        lp = f"{pre}layers.{i}."
        a, m = f"{lp}self_attn.", f"{lp}mlp."
        out[f"{lp}input_layernorm.weight"] = (H,)
        for n, rows, cols in (("q", q_rows, H), ("k", kv_rows, H), ("v", kv_rows, H),
                              ("o", H, q_rows)):
            out[f"{a}{n}_proj.weight"] = (rows, cols)
            if cfg.attention_bias:
                out[f"{a}{n}_proj.bias"] = (rows,)
        out[f"{a}sinks"] = (cfg.num_heads,)
        out[f"{lp}post_attention_layernorm.weight"] = (H,)
        out[f"{m}router.weight"] = (E, H)
        out[f"{m}router.bias"] = (E,)
        if is_mxfp4(cfg):
            out[f"{m}experts.gate_up_proj_blocks"] = (E, 2 * I, H // 32, 16)
            out[f"{m}experts.gate_up_proj_scales"] = (E, 2 * I, H // 32)
            out[f"{m}experts.down_proj_blocks"] = (E, H, I // 32, 16)
            out[f"{m}experts.down_proj_scales"] = (E, H, I // 32)
        else:
            out[f"{m}experts.gate_up_proj"] = (E, H, 2 * I)
            out[f"{m}experts.down_proj"] = (E, I, H)
        out[f"{m}experts.gate_up_proj_bias"] = (E, 2 * I)
        out[f"{m}experts.down_proj_bias"] = (E, H)
    out[f"{pre}norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    return out


def deinterleave(t: Tensor, dim: int) -> Tensor:
    """Interleaved gate / up along `dim` (even: gate, odd: up) -> [gate | up]."""
    n = t.shape[dim]
    even = torch.arange(0, n, 2, device=t.device)
    return torch.cat((t.index_select(dim, even), t.index_select(dim, even + 1)), dim)


def runtime_tensors(cfg: ModelConfig, raw, dtype) -> dict[str, object]:
    """Runtime-named tensors from `raw(name)` (a tensor as stored): non-expert tensors renamed
    as they are and cast to `dtype`; every layer's experts as banks (MXFP4 `QuantBank`s as
    stored, or dense [E, 2I, H] / [E, H, I] in `dtype`) and their regrouped biases."""
    out: dict[str, object] = {}
    pre = cfg.weight_prefix
    expert = ".mlp.experts."
    for name in expected_tensors_gpt_oss(cfg):
        if expert in name:
            continue
        rt = "model." + name[len(pre):] if name.startswith(pre) else name
        out[rt] = raw(name).to(dtype).contiguous()
    for i in range(cfg.num_layers):
        d, r = f"{pre}layers.{i}.mlp.experts.", f"model.layers.{i}.mlp."
        if is_mxfp4(cfg):
            gu = mxfp4_bank(raw(d + "gate_up_proj_blocks"), raw(d + "gate_up_proj_scales"),
                            interleaved_gate_up=True)
            dn = mxfp4_bank(raw(d + "down_proj_blocks"), raw(d + "down_proj_scales"))
        else:
            gu = deinterleave(raw(d + "gate_up_proj").transpose(1, 2), 1).to(dtype).contiguous()
            dn = raw(d + "down_proj").transpose(1, 2).to(dtype).contiguous()  # [E, H, I]
        out[r + "experts.gate_up_proj"], out[r + "experts.down_proj"] = gu, dn
        out[r + "gate_up_bias"] = deinterleave(raw(d + "gate_up_proj_bias"), 1).to(
            dtype).contiguous()
        out[r + "down_bias"] = raw(d + "down_proj_bias").to(dtype).contiguous()
    return out
