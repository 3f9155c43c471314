"""What the families' tensor layouts share (checkpoint/layout.py for Qwen, layout_mla.py for
DeepSeek-V3 and Kimi-Linear): the decoder stack's skeleton, the dense SwiGLU MLP and the
per-expert tensors of a routed MoE block. Shapes as `layout.expected_tensors` (H hidden,
D dense intermediate, E experts, I moe intermediate)."""
from __future__ import annotations

from collections.abc import Callable

from freetoken.types.model_config import ModelConfig

Shape = tuple[int, ...]


def dense_mlp(p: str, D: int, H: int) -> dict[str, Shape]:
    """A SwiGLU MLP of intermediate size D under prefix `p`."""
    return {f"{p}gate_proj.weight": (D, H), f"{p}up_proj.weight": (D, H),
            f"{p}down_proj.weight": (H, D)}


def routed_experts(p: str, E: int, I: int, H: int,
                   names: tuple[str, str, str]) -> dict[str, Shape]:
    """E experts `{p}experts.{e}.{gate,up,down}.weight`, `names` the three projections."""
    gate, up, down = names
    out: dict[str, Shape] = {}
    for e in range(E):
        out[f"{p}experts.{e}.{gate}.weight"] = (I, H)
        out[f"{p}experts.{e}.{up}.weight"] = (I, H)
        out[f"{p}experts.{e}.{down}.weight"] = (H, I)
    return out


def decoder_stack(cfg: ModelConfig,
                  attention: Callable[[int, str], dict[str, Shape]],
                  mlp: Callable[[int, str], dict[str, Shape]]) -> dict[str, Shape]:
    """Embeddings, then per layer i its input norm, `attention(i, layer prefix)`, its
    post-attention norm and `mlp(i, layer prefix)`, then the final norm and (untied) lm_head,
    in this order."""
    pre, H = cfg.weight_prefix, cfg.hidden_size
    out: dict[str, Shape] = {f"{pre}embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        lp = f"{pre}layers.{i}."
        out[f"{lp}input_layernorm.weight"] = (H,)
        out.update(attention(i, lp))
        out[f"{lp}post_attention_layernorm.weight"] = (H,)
        out.update(mlp(i, lp))
    out[f"{pre}norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    return out
