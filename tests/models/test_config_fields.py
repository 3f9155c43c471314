"""The fields every family's `config.json` reader shares (types/config_record.py
`required_dims`, `eos_ids_of`, `weight_dtype`), through `config_from_dict` for each family.
Bugs it catches: a Qwen config without `vocab_size` escaping as a bare KeyError (it was read
outside the required-field check), and the three readers drifting apart on eos and dtype."""
from __future__ import annotations

import pytest

from freetoken.types.model_config import ConfigError, config_from_dict

BASE = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4}
FAMILIES = {"qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 32, "num_key_value_heads": 2},
            "deepseek_v3": {}, "kimi_linear": {}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("field", sorted(BASE))
def test_a_missing_required_field_is_named(family: str, field: str) -> None:
    raw = {"model_type": family, **BASE, **FAMILIES[family]}
    del raw[field]
    with pytest.raises(ConfigError, match=field):
        config_from_dict(raw)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eos_and_dtype_read_alike(family: str) -> None:
    raw = {"model_type": family, **BASE, **FAMILIES[family]}
    for eos, want in ((7, (7,)), ([7, 9], (7, 9))):
        assert config_from_dict({**raw, "eos_token_id": eos}).eos_token_ids == want
    for given, want in (("torch.float16", "float16"), ("float32", "float32"),
                        ("float8_e4m3fn", "bfloat16")):
        assert config_from_dict({**raw, "torch_dtype": given}).dtype == want
        assert config_from_dict({**raw, "dtype": given, "torch_dtype": "float32"}).dtype == want
