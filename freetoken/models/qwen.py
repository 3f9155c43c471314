"""Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE (text) as one decoder: per-layer full attention or gated
DeltaNet, then a MoE block (or a dense MLP on `mlp_only_layers`). Parameter names equal the
runtime tensor names produced by `freetoken.checkpoint.load_checkpoint`.

Shapes: T packed new tokens, H hidden, V vocab, R rows whose logits are wanted.
"""
from __future__ import annotations

import torch
from torch import nn

from freetoken.cache.tensors import Caches
from freetoken.kernels.cpu.linear_ops import small_linear
from freetoken.layers.attention import Attention
from freetoken.layers.linear_attention import GatedDeltaNet
from freetoken.layers.moe import MLP, MoEBlock
from freetoken.layers.norm import RMSNorm, add_rmsnorm
from freetoken.layers.rotary import Rotary
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.is_linear = cfg.layer_types[i] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, i)
        else:
            self.self_attn = Attention(cfg, i)
        self.is_moe = cfg.is_moe_layer(i)
        self.mlp: nn.Module = (MoEBlock(cfg, i) if self.is_moe
                               else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                cfg.zero_centered_norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, caches: Caches, h: torch.Tensor | None = None,
                next_norm: RMSNorm | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] residual stream -> the layer's output. `h`: input_layernorm(x) when the
        previous layer computed it. With `next_norm` (the next layer's input norm) returns
        (x, next_norm(x)): a MoE block computes that norm in its combine launch."""
        if h is None:
            h = self.input_layernorm(x)
        if self.is_linear:
            assert caches.state is not None
            h = self.linear_attn(h, batch, caches.state)
        else:
            h = self.self_attn(h, cos, sin, batch, caches.kv)
        h, x = add_rmsnorm(self.post_attention_layernorm, h, x)  # x += h; h = norm(x)
        if self.is_moe:  # the block adds the residual itself (one fused pass on CUDA)
            return self.mlp(h, batch.moe, residual=x, next_norm=next_norm)
        x = x + self.mlp(h)
        return x if next_norm is None else (x, next_norm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm)


class QwenMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # weight only
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)

    def output_embedding(self) -> torch.Tensor:
        return (
            self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        )

    @torch.no_grad()
    def dedup_output_head(self, max_share: float = 0.5) -> int | None:
        """Where at most `max_share` of the output head's rows are distinct (the trained demo:
        6,645 of 151,680 ids, every id its data never used sharing one row), compute the logits
        of the distinct rows only and give each id its row's: the same logits for 1/23 of the
        head's bytes, which on the CPU is most of a demo decode step. Returns the distinct row
        count, or None where the head is left as it is (every real checkpoint: one matrix-vector
        signature rules it out without sorting rows)."""
        w = self.output_embedding()
        g = torch.Generator(device="cpu").manual_seed(0)
        probe = torch.randn(w.shape[1], generator=g, dtype=torch.float32).to(w.device)
        # in row chunks: a real head in fp32 at once would be a multi-GB copy at every load
        sig = torch.cat([c.float() @ probe for c in w.split(8192)])  # [V]
        sig, index = torch.unique(sig, return_inverse=True)  # [U], [V]
        if sig.numel() > max_share * w.shape[0]:
            return None
        # equal rows have equal signatures; the groups are exact only if no two different rows
        # share one, which the check below proves (else: sort the rows themselves)
        first = torch.full((sig.numel(),), w.shape[0], dtype=torch.long, device=w.device)
        first.scatter_reduce_(0, index, torch.arange(w.shape[0], device=w.device), "amin")
        rows = w[first]  # [U, H]: each group's first row
        if not torch.equal(rows[index], w):
            rows, index = torch.unique(w, dim=0, return_inverse=True)  # [U, H], [V]
        # buffers (moved with the model), not in the state dict: derived from the head
        self.register_buffer("head_rows", rows.contiguous(), persistent=False)
        self.register_buffer("head_index", index, persistent=False)
        return rows.shape[0]

    def fuse_projections(self) -> QwenMoE:
        """Concatenate the projections that read the same input (q/k/v; the four gated-DeltaNet
        input projections; a shared expert's gate and up) into one weight each, the layers'
        weights becoming views of it: one GEMM per group in every path. Call after the model is
        on its device (moving it afterwards would copy the views apart)."""
        for m in self.modules():
            if m is not self and hasattr(m, "fuse_projections"):
                m.fuse_projections()
        return self

    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE blocks in layer order (the expert runtime's `MoEHost` protocol)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: Caches) -> torch.Tensor:
        """Runs the packed batch, writes its K/V and recurrent state, returns logits [R, V] fp32."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)  # [T, rotary_dim]
        layers = self.model.layers
        h = None  # the next layer's normalised input, from the previous layer's last launch
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            out = layer(x, cos, sin, batch, caches, h=h, next_norm=nxt)
            x, h = out if nxt is not None else (out, None)
        h = self.model.norm(x[batch.logits_rows])  # [R, H]
        index = self._buffers.get("head_index")  # (`dedup_output_head`)
        if index is not None:  # the distinct rows' logits [R, U] -> each id's row's: [R, V]
            return small_linear(h, self._buffers["head_rows"]).float().index_select(1, index)
        return small_linear(h, self.output_embedding()).float()  # [R, V]
