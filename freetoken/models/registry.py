"""model_type → model class. Families not listed run the Qwen decoder (freetoken/models/qwen.py)."""
from __future__ import annotations

from freetoken.models.qwen import QwenMoE
from freetoken.types.model_config import ModelConfig


def model_class(cfg: ModelConfig) -> type[QwenMoE]:
    if cfg.model_type == "deepseek_v3":
        from freetoken.models.deepseek import DeepseekV3

        return DeepseekV3
    if cfg.model_type == "gpt_oss":
        from freetoken.models.gpt_oss import GptOss

        return GptOss
    if cfg.model_type == "glm_moe_dsa":
        from freetoken.models.glm import GlmMoeDsa

        return GlmMoeDsa
    if cfg.model_type == "deepseek_v4":
        from freetoken.models.deepseek_v4 import DeepseekV4

        return DeepseekV4
    if cfg.model_type == "kimi_linear":
        from freetoken.models.kimi import KimiLinear

        return KimiLinear
    return QwenMoE
