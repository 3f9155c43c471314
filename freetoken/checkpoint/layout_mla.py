"""The tensors of a DeepSeek-V3 (`deepseek_v3`), GLM-5 (`glm_moe_dsa`) or Kimi-Linear
(`kimi_linear`) checkpoint, as `layout.expected_tensors`: MLA layers (GLM-5's "full" layers with
their sparse-attention indexer), Kimi Delta Attention layers (kimi), dense or
group-limited MoE blocks under `cfg.moe_module` with experts named `cfg.expert_names`.

Legend: H hidden, Hq heads, N qk_nope_head_dim, R qk_rope_head_dim, C kv_lora_rank, Q q_lora_rank,
Dv v_head_dim, E experts, I moe intermediate, S shared intermediate (n_shared_experts·I),
D dense intermediate, Hl / d KDA heads and head dim, Kc conv kernel. Multi-token-prediction
layers (`model.layers.{num_hidden_layers}.*`) are not listed: the reader skips them.
"""
from __future__ import annotations

from freetoken.checkpoint.layout_parts import Shape, decoder_stack, dense_mlp, routed_experts
from freetoken.types.model_config import ModelConfig


def _mla(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    H, Hq, C, R = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q_rows = Hq * (cfg.qk_nope_head_dim + R)
    out: dict[str, Shape] = {}
    if cfg.q_lora_rank:
        Q = cfg.q_lora_rank
        out.update({f"{p}q_a_proj.weight": (Q, H), f"{p}q_a_layernorm.weight": (Q,),
                    f"{p}q_b_proj.weight": (q_rows, Q)})
        if cfg.attention_bias:
            out[f"{p}q_a_proj.bias"] = (Q,)
    else:
        out[f"{p}q_proj.weight"] = (q_rows, H)
    out.update({
        f"{p}kv_a_proj_with_mqa.weight": (C + R, H),
        f"{p}kv_a_layernorm.weight": (C,),
        f"{p}kv_b_proj.weight": (Hq * (cfg.qk_nope_head_dim + cfg.v_head_dim), C),
        f"{p}o_proj.weight": (H, Hq * cfg.v_head_dim),
    })
    if cfg.attention_bias:
        out.update({f"{p}kv_a_proj_with_mqa.bias": (C + R,), f"{p}o_proj.bias": (H,)})
    return out


def _indexer(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    """GLM-5's sparse-attention indexer (a "full" layer's): Hi heads of Di."""
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    return {f"{p}wq_b.weight": (Hi * Di, cfg.q_lora_rank), f"{p}wk.weight": (Di, cfg.hidden_size),
            f"{p}k_norm.weight": (Di,), f"{p}k_norm.bias": (Di,),
            f"{p}weights_proj.weight": (Hi, cfg.hidden_size)}


def _kda(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    H, Hl, d = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_key_head_dim
    out: dict[str, Shape] = {}
    for n in ("q", "k", "v"):
        out[f"{p}{n}_proj.weight"] = (Hl * d, H)
        out[f"{p}{n}_conv1d.weight"] = (Hl * d, 1, cfg.linear_conv_kernel)
    out.update({
        f"{p}f_a_proj.weight": (d, H), f"{p}f_b_proj.weight": (Hl * d, d),
        f"{p}dt_bias": (Hl * d,), f"{p}A_log": (1, 1, Hl, 1), f"{p}b_proj.weight": (Hl, H),
        f"{p}g_a_proj.weight": (d, H), f"{p}g_b_proj.weight": (Hl * d, d),
        f"{p}o_norm.weight": (d,), f"{p}o_proj.weight": (H, Hl * d),
    })
    return out


def _mlp(cfg: ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    H = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return dense_mlp(p, cfg.intermediate_size, H)
    E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out: dict[str, Shape] = {f"{p}gate.weight": (E, H), f"{p}gate.e_score_correction_bias": (E,)}
    out.update(routed_experts(p, E, I, H, cfg.expert_names))
    out.update(dense_mlp(f"{p}shared_experts.", S, H))
    return out


def expected_tensors_mla(cfg: ModelConfig) -> dict[str, Shape]:
    def attention(i: int, lp: str) -> dict[str, Shape]:
        if cfg.layer_types[i] == "linear_attention":
            return _kda(cfg, f"{lp}self_attn.")
        if cfg.indexer_types and cfg.indexer_types[i] == "full":
            return {**_mla(cfg, f"{lp}self_attn."), **_indexer(cfg, f"{lp}self_attn.indexer.")}
        return _mla(cfg, f"{lp}self_attn.")

    return decoder_stack(cfg, attention, lambda i, lp: _mlp(cfg, i, f"{lp}{cfg.moe_module}."))


def router_tensors(cfg: ModelConfig) -> set[str]:
    """The router's weight and correction bias of every MoE layer, KDA's dt_bias and the
    sparse-attention indexer's weights_proj (kept in float32)."""
    pre = cfg.weight_prefix
    out = {f"{pre}layers.{i}.{cfg.moe_module}.gate.{n}" for i in cfg.moe_layers
           for n in ("weight", "e_score_correction_bias")}
    out |= {f"{pre}layers.{i}.self_attn.indexer.weights_proj.weight"
            for i, t in enumerate(cfg.indexer_types) if t == "full"}
    return out | {f"{pre}layers.{i}.self_attn.dt_bias" for i in cfg.linear_attention_layers
                  if cfg.linear_kind == "kda"}
