"""DeepSeek-V3 (`deepseek_v3`): multi-head latent attention (freetoken/layers/mla.py) on every
layer; the first `first_k_dense_replace` layers a dense MLP, the rest group-limited MoE with
shared experts (freetoken/layers/routing.py). The decoder, its forward and the expert-backend
plumbing are QwenMoE's; only the layers and the rotary (YaRN, interleaved pairs) differ.
Parameter names equal transformers' (the checkpoint's, prefix normalised to `model.`).
"""
from __future__ import annotations

from torch import nn

from freetoken.layers.mla import MLAttention
from freetoken.layers.moe import MLP
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope_scaling import make_rotary
from freetoken.layers.routing import GroupLimitedMoE
from freetoken.models.qwen import DecoderLayer, QwenMoE
from freetoken.types.model_config import ModelConfig


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, i: int):
        nn.Module.__init__(self)
        self.is_linear = False
        self.self_attn = MLAttention(cfg, i)
        self.is_moe = cfg.is_moe_layer(i)
        self.mlp: nn.Module = (GroupLimitedMoE(cfg, i) if self.is_moe
                               else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)


class DeepseekBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)


class DeepseekV3(QwenMoE):
    backbone: type[nn.Module] = DeepseekBackbone  # GLM-5's (models/glm.py) adds its indexers

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.model = self.backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # weight only
        self.rotary = make_rotary(cfg.rotary_dim, cfg.rope_theta, dict(cfg.rope_scaling),
                                  cfg.max_position_embeddings)
