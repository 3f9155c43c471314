"""The model configuration record (`ModelConfig`) and its error, apart from the parsers
(model_config.py for the Qwen families, deepseek_config.py, kimi_config.py), which all
build it: the family parsers import this module, never each other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # qwen3_next / qwen3_5: zero-centred norms `(1 + w)` and a sigmoid gate on attention output
    zero_centered_norm: bool
    attn_output_gate: bool
    # MoE
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    intermediate_size: int  # dense MLP layers (mlp_only_layers / decoder_sparse_step)
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    # gated DeltaNet (linear attention)
    linear_conv_kernel: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_fused_qkvz: bool = False  # qwen3_next: in_proj_qkvz / in_proj_ba grouped per K-head
    # multi-head latent attention (deepseek_v3; freetoken/types/deepseek_config.py): the KV pool
    # holds one latent per token, [kv_lora_rank | qk_rope_head_dim]. q_lora_rank 0: no q LoRA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary on interleaved pairs (x0, x1), (x2, x3), ...
    # RoPE scaling as configured, sorted (key, value) pairs (`rope_type` "yarn" is the one read)
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    # routing: "softmax" (qwen) or "sigmoid" with a correction bias and group limits (deepseek)
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # qwen: sigmoid gate on the shared expert; deepseek: none
    mla_rope: bool = True  # kimi_linear's MLA is NoPE: its "rope" part of the key is not rotated
    # DeepSeek sparse attention (glm_moe_dsa; freetoken/types/glm_config.py): per layer "full"
    # (runs its indexer: top `index_topk` tokens per query) or "shared" (reuses the previous
    # full layer's choice); () for dense MLA
    indexer_types: tuple[str, ...] = ()
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    # linear-attention kind: "gdn" (gated DeltaNet, qwen) or "kda" (Kimi Delta Attention)
    linear_kind: str = "gdn"
    # where a layer's MLP / MoE block and its experts' projections sit in the checkpoint
    # (kimi_linear: `block_sparse_moe`, experts w1 / w3 / w2)
    moe_module: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    # gpt_oss (freetoken/types/gpt_oss_config.py): attention sinks, a sliding window on the
    # `sliding_layers` (their KV stays in the pool; attention masks keys outside the window),
    # and the experts' clamped SwiGLU ("swiglu_oai" with alpha / limit) with biases
    attention_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    expert_act: str = "silu"  # "silu", "swiglu_oai" (gpt_oss), "clamp" (deepseek_v4)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # deepseek_v4 (freetoken/types/deepseek_v4_config.py): compressed attention, hyper-connections
    dsv4: DSV4Spec | None = None
    # checkpoint facts
    weight_prefix: str = "model."
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_entry(self) -> tuple[int, int, int]:
        """(heads, K dim, V dim) of one token's entry in the KV pool: MLA stores its latent
        [kv_lora_rank | qk_rope_head_dim] as one head and no V (V is read from the latent);
        with sparse attention the "V" of the entry is the indexer's key [index_head_dim]."""
        if self.is_mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, self.index_dim
        if self.dsv4 is not None:
            return 1, *self.dsv4.entry_dims(self.head_dim, self.index_head_dim)
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def index_dim(self) -> int:
        """Width of the indexer key each token keeps in the pool (0: no sparse attention)."""
        return self.index_head_dim if "full" in self.indexer_types else 0

    @property
    def has_linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def is_moe_layer(self, i: int) -> bool:
        if self.num_experts <= 0 or i in self.mlp_only_layers:
            return False
        return (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def expert_bytes(self, dtype: torch.dtype | ExpertFormat | None = None) -> int:
        """Bytes of one routed expert (gate + up + down) in `dtype` (default: the checkpoint's
        expert format, `expert_format`)."""
        return expert_nbytes(self.hidden_size, self.moe_intermediate_size,
                             dtype or self.expert_format)

    @property
    def expert_format(self) -> ExpertFormat | torch.dtype:
        """The routed experts' storage: the checkpoint's quantization (`extra["expert_format"]`,
        set by the config parser from `quantization_config`), else the model dtype."""
        fmt = self.extra.get("expert_format")
        return fmt if isinstance(fmt, ExpertFormat) else self.torch_dtype


@dataclass(frozen=True)
class DSV4Spec:
    """DeepSeek-V4's attention and residual facts (freetoken/layers/compressed_attention.py,
    freetoken/layers/hyper_connection.py).

    `kinds` per layer: "sliding" (the window only), "csa" (the window plus compressed sparse
    attention: one entry per `csa_rate` tokens over overlapping windows of 2 x `csa_rate`, a
    lightning indexer picking `index_topk` of them per query) or "hca" (the window plus one
    entry per `hca_rate` tokens, every one read). The compressed branches rotate with their
    own rope (`compress_theta`, `compress_scaling`: YaRN pairs as `rope_scaling`).
    The residual is `hc_mult` streams mixed by hyper-connections (Sinkhorn, `hc_iters`).
    The first layers route by a fixed token -> experts table (`hash_layers`).
    """

    kinds: tuple[str, ...]
    csa_rate: int = 4
    hca_rate: int = 128
    compress_theta: float = 160000.0
    compress_scaling: tuple[tuple[str, Any], ...] = ()
    hc_mult: int = 4
    hc_iters: int = 20
    hc_eps: float = 1e-6
    hash_layers: tuple[int, ...] = ()
    o_groups: int = 8
    o_lora_rank: int = 1024

    @property
    def has_csa(self) -> bool:
        return "csa" in self.kinds

    def entry_dims(self, d: int, di: int) -> tuple[int, int]:
        """(K, V) widths of one token's pool entry, the same on every layer (the widest kind):
        K = [window kv D | compressed entry D | indexer entry Di], V = the compressors' raw
        per-token inputs [kv 2D | gate 2D | indexer kv 2Di | indexer gate 2Di] (CSA) or
        [kv D | gate D] (HCA only). A compressed entry sits at the slot of its window's last
        token; the raw inputs let a later chunk close a window a cached prefix left open."""
        if self.has_csa:
            return 2 * d + di, 4 * d + 4 * di
        if "hca" in self.kinds:
            return 2 * d, 2 * d
        return d, 0


def _get(d: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def required_dims(raw: dict) -> tuple[int, int, int, int]:
    """(num_hidden_layers, hidden_size, num_attention_heads, vocab_size) of a family's
    `config.json`; ConfigError naming the first one missing."""
    try:
        return tuple(int(raw[k]) for k in ("num_hidden_layers", "hidden_size",
                                          "num_attention_heads", "vocab_size"))  # type: ignore
    except KeyError as e:
        raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None


def eos_ids_of(raw: dict, default: int | None = None) -> tuple[int, ...]:
    """`eos_token_id` (one id or a list) as a tuple; () when absent and no default."""
    eos = raw.get("eos_token_id", default)
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def weight_dtype(raw: dict) -> str:
    """The checkpoint's `dtype` / `torch_dtype` as a ModelConfig dtype name (bfloat16 for any
    other or none)."""
    dtype = str(_get(raw, "dtype", "torch_dtype", default="bfloat16")).replace("torch.", "")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"


@dataclass(frozen=True)
class ExpertFormat:
    """How a routed expert's weights are stored, from the host store to the GPU slots:
    "bf16" / "float32" (dense, the model dtype), "fp8" (e4m3 with one float32 scale per
    `block` x `block` tile, Qwen3.6-FP8 / DeepSeek's `weight_scale_inv`) or "mxfp4" (e2m1 codes
    two a byte, one e8m0 scale per 32 values, gpt-oss's `_blocks` / `_scales`). The banks
    themselves are `freetoken.kernels.quant.QuantBank`s for the quantized formats."""

    name: str = "bfloat16"
    block: int = 128

    @property
    def quantized(self) -> bool:
        return self.name in ("fp8", "mxfp4")

    def bank_nbytes(self, rows: int, cols: int, halves: int = 1) -> int:
        """Bytes of one expert's [rows, cols] matrix with its scales (a gate_up matrix has
        halves = 2: gate and up keep their own fp8 block grids)."""
        if self.name == "fp8":
            half = rows // halves
            grid = halves * -(-half // self.block) * -(-cols // self.block)
            return rows * cols + 4 * grid
        if self.name == "mxfp4":
            return rows * cols // 2 + rows * cols // 32
        return rows * cols * torch.empty((), dtype=getattr(torch, self.name)).element_size()


def expert_nbytes(hidden: int, inter: int, dtype: torch.dtype | ExpertFormat) -> int:
    """Bytes of one routed expert (gate + up + down, scales included) — the one place this is
    computed. `dtype`: the dense dtype, or the bank format."""
    if isinstance(dtype, torch.dtype):
        return 3 * hidden * inter * torch.empty((), dtype=dtype).element_size()
    return dtype.bank_nbytes(2 * inter, hidden, 2) + dtype.bank_nbytes(hidden, inter)
