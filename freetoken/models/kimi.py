"""Kimi-Linear (`kimi_linear`): Kimi Delta Attention layers (freetoken/layers/kda.py) beside NoPE
multi-head latent attention (freetoken/layers/mla.py), each followed by a dense MLP or the
group-limited MoE of DeepSeek-V3 (freetoken/layers/routing.py). Module names are the
checkpoint's (`self_attn` for both attention kinds, `block_sparse_moe` for the MLP); the decoder,
its forward and the expert-backend plumbing are QwenMoE's.
"""
from __future__ import annotations

from torch import nn

from freetoken.layers.kda import KimiDeltaAttention
from freetoken.layers.mla import MLAttention
from freetoken.layers.moe import MLP
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import Rotary
from freetoken.layers.routing import GroupLimitedMoE
from freetoken.models.qwen import DecoderLayer, QwenMoE
from freetoken.types.model_config import ModelConfig


class KimiDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, i: int):
        nn.Module.__init__(self)
        self.is_linear = cfg.layer_types[i] == "linear_attention"
        self.self_attn = (KimiDeltaAttention(cfg, i) if self.is_linear else MLAttention(cfg, i))
        self.is_moe = cfg.is_moe_layer(i)
        self.block_sparse_moe: nn.Module = (GroupLimitedMoE(cfg, i) if self.is_moe
                                            else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)

    # the names DecoderLayer.forward and QwenMoE.moe_blocks read
    @property
    def mlp(self) -> nn.Module:
        return self.block_sparse_moe

    @property
    def linear_attn(self) -> nn.Module:
        return self.self_attn


class KimiBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(KimiDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False)


class KimiLinear(QwenMoE):
    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.model = KimiBackbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # weight only
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)  # its cos/sin go unused (NoPE)
