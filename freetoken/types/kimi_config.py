"""HF `config.json` of Kimi-Linear (`kimi_linear`) → `ModelConfig`.

Kimi-Linear interleaves Kimi Delta Attention layers (`linear_attention`: a gated delta rule with a
per-channel decay, short convolutions on q, k and v) with NoPE multi-head latent attention
(`full_attention`), and runs DeepSeek-V3's group-limited sigmoid routing with shared experts.
Field names are read in both spellings: transformers' saved names (`num_experts`,
`num_experts_per_token`, `num_expert_group`, `num_shared_experts`, `moe_renormalize`,
`model_max_length`) and the attribute names (`num_local_experts`, `num_experts_per_tok`, `n_group`,
...). Layer kinds come from `layer_types`, else the checkpoint's `linear_attn_config`
(`kda_layers` / `full_attn_layers`, 1-indexed), else transformers' default rule; MLP kinds from
`mlp_layer_types`, else `first_k_dense_replace`. Missing fields take transformers' defaults.
"""
from __future__ import annotations

from freetoken.types.config_record import (
    ConfigError,
    ModelConfig,
    _get,
    eos_ids_of,
    required_dims,
    weight_dtype,
)


def _layer_types(raw: dict, n: int) -> list[str]:
    lt = raw.get("layer_types")
    lac = raw.get("linear_attn_config") or {}
    if lt is None and "full_attn_layers" in lac and "kda_layers" in lac:
        lt = [None] * n
        for i in lac["full_attn_layers"]:
            lt[i - 1] = "full_attention"
        for i in lac["kda_layers"]:
            lt[i - 1] = "linear_attention"
    if lt is None:
        lt = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(lt) != n or any(t not in ("full_attention", "linear_attention") for t in lt):
        raise ConfigError(f"kimi_linear: layer_types {lt} do not name {n} known layer kinds")
    return list(lt)


def kimi_config(raw: dict, prefix: str = "model.") -> ModelConfig:
    n_layers, hidden, n_heads, vocab = required_dims(raw)
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"kimi_linear: hidden_act {raw.get('hidden_act')!r} is not supported")
    act = raw.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise ConfigError(f"kimi_linear: router activation {act!r} is not supported (sigmoid)")
    if raw.get("quantization_config"):
        raise ConfigError("kimi_linear: quantized checkpoints are not supported")
    lac = raw.get("linear_attn_config") or {}
    head_dim = int(_get(raw, "linear_head_dim", default=lac.get("head_dim", 128)))
    lin_heads = int(_get(raw, "linear_num_heads", default=lac.get("num_heads", 32)))
    conv = int(_get(raw, "linear_conv_kernel_dim", default=lac.get("short_conv_kernel_size", 4)))
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        k = int(_get(raw, "first_k_dense_replace", default=1))
        mlp_types = ["dense" if i < k else "sparse" for i in range(n_layers)]
    n_experts = int(_get(raw, "num_experts", "num_local_experts", "n_routed_experts", default=256))
    n_group = int(_get(raw, "num_expert_group", "n_group", default=1))
    topk_group = int(_get(raw, "topk_group", default=1))
    if n_experts % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(f"kimi_linear: {n_experts} experts in {n_group} groups, "
                          f"topk_group={topk_group}")
    moe_inter = int(_get(raw, "moe_intermediate_size", default=1024))
    q_lora = raw.get("q_lora_rank")
    nope, rope_dim = int(_get(raw, "qk_nope_head_dim", default=128)), int(
        _get(raw, "qk_rope_head_dim", default=64))
    return ModelConfig(
        model_type="kimi_linear",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=1,
        head_dim=nope + rope_dim,
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-5)),
        layer_types=tuple(_layer_types(raw, n_layers)),
        rope_theta=10000.0,  # NoPE: unused
        partial_rotary_factor=1.0,
        max_position_embeddings=int(_get(raw, "model_max_length", "max_position_embeddings",
                                         default=1048576)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        zero_centered_norm=False,
        attn_output_gate=False,
        num_experts=n_experts,
        top_k=int(_get(raw, "num_experts_per_token", "num_experts_per_tok", default=8)),
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(_get(raw, "moe_renormalize", "norm_topk_prob", default=True)),
        shared_expert_intermediate_size=moe_inter * int(
            _get(raw, "num_shared_experts", "n_shared_experts", default=1)),
        intermediate_size=int(_get(raw, "intermediate_size", default=9216)),
        mlp_only_layers=tuple(i for i, t in enumerate(mlp_types) if t == "dense"),
        linear_conv_kernel=conv,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=lin_heads,
        linear_num_value_heads=lin_heads,
        q_lora_rank=int(q_lora) if q_lora else 0,
        kv_lora_rank=int(_get(raw, "kv_lora_rank", default=512)),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(_get(raw, "v_head_dim", default=128)),
        scoring_func="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=2.446)),
        shared_expert_gated=False,
        mla_rope=False,
        linear_kind="kda",
        moe_module="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
        weight_prefix=prefix,
        dtype=weight_dtype(raw),
        bos_token_id=raw.get("bos_token_id", 163584),
        eos_token_ids=eos_ids_of(raw, 163586),
        extra=raw,
    )
