"""A model in a real shape with random weights, built directly in memory (no checkpoint):
routed-expert banks on the host, everything else on the compute device."""
from __future__ import annotations

import torch
from tqdm import tqdm

from freetoken.checkpoint.layout import fp32_tensors
from freetoken.experts.calibrate import random_fill_
from freetoken.experts.fused import FusedExperts
from freetoken.kernels.quant import QuantBank, quantize_bank
from freetoken.models.qwen import QwenMoE
from freetoken.models.random_weights import dsv4_constant, hash_table
from freetoken.types.model_config import ExpertFormat, ModelConfig


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 seed: int = 0, progress: bool = True, experts: bool = True) -> QwenMoE:
    """Non-expert weights ~N(0, 0.02) on `device`; expert banks on the CPU (move or hand them
    to an expert store yourself), or, with `experts=False`, empty (`random_quant_banks` makes
    quantized ones). Norm weights as a trained model's are near: zero-centred 0, plain 1.
    A_log = log(U(1, 16)), dt_bias = 1. DeepSeek-V4: its float32 parameters in float32, its
    hyper-connection biases / scales, sinks and position biases as transformers initialises
    them, its `tid2eid` buffers random distinct experts per token."""
    torch.manual_seed(seed)
    from freetoken.models.loader import meta_without_init
    from freetoken.models.registry import model_class

    with meta_without_init():
        model = model_class(cfg)(cfg)
    params = list(model.named_parameters())
    # deepseek_v4: the parameters transformers keeps in float32 are float32 here too
    fp32 = fp32_tensors(cfg) if cfg.dsv4 is not None else set()
    for name, p in tqdm(params, desc="random weights", disable=not progress, unit="t"):
        on = "cpu" if ".experts." in name else device
        t = torch.empty(p.shape if experts or on != "cpu" else (0,),
                        dtype=torch.float32 if name in fp32 else dtype, device=on)
        if dsv4_constant(name) is not None:
            t.fill_(dsv4_constant(name))
        elif name.endswith("A_log"):
            t.uniform_(1, 16).log_()
        elif name.endswith("dt_bias") or (name.endswith("norm.weight") and "linear_attn" in name):
            t.fill_(1.0)
        elif name.endswith("norm.bias"):  # GLM-5's indexer LayerNorm
            t.zero_()
        elif "norm" in name:
            t.fill_(0.0 if cfg.zero_centered_norm else 1.0)
        elif on == "cpu":
            random_fill_(t, 0.02, seed=hash(name) % 2**31)
        else:
            t.normal_(0, 0.02)
        mod_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, torch.nn.Parameter(t, requires_grad=False))
    for name, buf in list(model.named_buffers()):  # deepseek_v4's hash-routing tables
        if name.endswith("tid2eid") and buf.is_meta:
            mod_name, _, attr = name.rpartition(".")
            model.get_submodule(mod_name).register_buffer(
                attr, hash_table(tuple(buf.shape), cfg.num_experts, 0).to(device))
    for b in model.moe_blocks():
        assert isinstance(b.experts, FusedExperts)
    return model.eval().fuse_projections()


def random_quant_banks(cfg: ModelConfig, fmt: ExpertFormat, seed: int = 0, distinct: int = 4
                       ) -> tuple[list[QuantBank], list[QuantBank]]:
    """Per MoE layer, (gate_up, down) banks in `fmt` of `distinct` random experts (~N(0, 0.02)
    quantized as a release is) repeated over the layer's E experts: the real bytes and layout
    at a fraction of the time quantizing every expert would take."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(E) % distinct
    gus, dns = [], []
    for _ in cfg.moe_layers:
        n = min(distinct, E)
        gu = quantize_bank(torch.randn(n, 2 * I, H, generator=g) * 0.02, fmt.name, fmt.block, 2)
        dn = quantize_bank(torch.randn(n, H, I, generator=g) * 0.02, fmt.name, fmt.block, 1)
        gus.append(gu.index_select(0, idx % n))
        dns.append(dn.index_select(0, idx % n))
    return gus, dns
