"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3's decoder (freetoken/models/deepseek.py) with DeepSeek
sparse attention (freetoken/layers/dsa.py) on every layer. The layers share one `TopkShare`: a
"shared" layer attends over the tokens the previous "full" layer's indexer picked in the same
forward pass. Parameter names equal transformers' (`self_attn.indexer.*`)."""
from __future__ import annotations

from torch import nn

from freetoken.layers.dsa import SparseMLAttention, TopkShare
from freetoken.layers.moe import MLP
from freetoken.layers.norm import RMSNorm
from freetoken.layers.routing import GroupLimitedMoE
from freetoken.models.deepseek import DeepseekV3
from freetoken.models.qwen import DecoderLayer
from freetoken.types.model_config import ModelConfig


class GlmDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, i: int, share: TopkShare):
        nn.Module.__init__(self)
        self.is_linear = False
        self.self_attn = SparseMLAttention(cfg, i, share)
        self.is_moe = cfg.is_moe_layer(i)
        self.mlp: nn.Module = (GroupLimitedMoE(cfg, i) if self.is_moe
                               else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)


class GlmBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        share = TopkShare()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GlmDecoderLayer(cfg, i, share) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)


class GlmMoeDsa(DeepseekV3):
    backbone = GlmBackbone
