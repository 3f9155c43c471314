"""HF `config.json` of GLM-5 (`glm_moe_dsa`) → `ModelConfig`.

GLM-5 is DeepSeek-V3's decoder (multi-head latent attention with q LoRA, group-limited sigmoid
routing with a correction bias, ungated shared experts, the first `first_k_dense_replace` layers
dense) plus DeepSeek sparse attention: a light indexer per "full" layer picks the `index_topk`
best earlier tokens of each query, and "shared" layers reuse the previous full layer's choice.
The rope is always on interleaved pairs (attention and indexer alike).

Missing fields take transformers' `GlmMoeDsaConfig` defaults (which differ from DeepSeek-V3's:
one expert group, q LoRA 2048, v 256, nope 192, rms eps 1e-5). `indexer_types` is read as
written, else from `index_topk_pattern` ("FSS..."), else from `index_topk_freq` /
`index_skip_topk_offset`, exactly as transformers derives it. Refused with a clear error: no q
LoRA (the indexer reads the q LoRA's output), a first layer that is not "full" (nothing to
share), and what deepseek_config refuses (other routing, activations, quantized checkpoints).
"""
from __future__ import annotations

from dataclasses import replace

from freetoken.types.config_record import ConfigError, ModelConfig, _get
from freetoken.types.deepseek_config import deepseek_config

# transformers 5.24 GlmMoeDsaConfig defaults where they differ from DeepseekV3Config's
_DEFAULTS = {"vocab_size": 154880, "intermediate_size": 12288, "q_lora_rank": 2048,
             "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
             "max_position_embeddings": 202752, "rms_norm_eps": 1e-5}


def _indexer_types(raw: dict, n: int) -> tuple[str, ...]:
    types = raw.get("indexer_types")
    if types is None:
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            m = {"F": "full", "S": "shared"}
            types = [m.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
        else:
            freq = max(int(_get(raw, "index_topk_freq", default=1)), 1)
            off = int(_get(raw, "index_skip_topk_offset", default=2))
            types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in ("full", "shared") for t in types):
        raise ConfigError(f"glm_moe_dsa: indexer_types {types} do not name {n} layers "
                          "'full' or 'shared'")
    if types[0] != "full":
        raise ConfigError("glm_moe_dsa: indexer_types[0] must be 'full' (a shared layer reuses "
                          "the previous full layer's top-k)")
    return tuple(types)


def glm_config(raw: dict, prefix: str = "model.") -> ModelConfig:
    raw = dict(raw)
    for k, v in _DEFAULTS.items():
        raw.setdefault(k, v)
    if not raw.get("q_lora_rank"):
        raise ConfigError("glm_moe_dsa: q_lora_rank must be set (the indexer reads the q "
                          "LoRA's output)")
    n = int(raw.get("num_hidden_layers", 0))
    mlp = raw.get("mlp_layer_types")
    if mlp is not None and (len(mlp) != n or any(t not in ("dense", "sparse") for t in mlp)):
        raise ConfigError(f"glm_moe_dsa: mlp_layer_types {mlp} do not name {n} layers")
    raw["rope_interleave"] = True  # GLM-5 rotates interleaved pairs; the config has no field
    try:
        base = deepseek_config(raw, prefix)
    except ConfigError as e:
        raise ConfigError(str(e).replace("deepseek_v3", "glm_moe_dsa")) from None
    dense = (tuple(i for i, t in enumerate(mlp) if t == "dense") if mlp is not None
             else base.mlp_only_layers)
    return replace(
        base, model_type="glm_moe_dsa", mlp_only_layers=dense,
        indexer_types=_indexer_types(raw, n),
        index_topk=int(_get(raw, "index_topk", default=2048)),
        index_head_dim=int(_get(raw, "index_head_dim", default=128)),
        index_n_heads=int(_get(raw, "index_n_heads", default=32)))
