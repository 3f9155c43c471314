"""A model in a real shape with random weights, built directly in memory (no checkpoint):
routed-expert banks on the host, everything else on the compute device."""
from __future__ import annotations

import torch
from tqdm import tqdm

from freetoken.experts.fused import FusedExperts
from freetoken.experts.random_fill import random_fill_
from freetoken.models.qwen import QwenMoE
from freetoken.types.model_config import ModelConfig


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 seed: int = 0, progress: bool = True) -> QwenMoE:
    """Non-expert weights ~N(0, 0.02) on `device`; expert banks on the CPU (move or hand them
    to an expert store yourself). Norm weights as a trained model's are near: zero-centred 0,
    plain 1. A_log = log(U(1, 16)), dt_bias = 1."""
    torch.manual_seed(seed)
    from freetoken.models.registry import model_class

    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    params = list(model.named_parameters())
    for name, p in tqdm(params, desc="random weights", disable=not progress, unit="t"):
        on = "cpu" if ".experts." in name else device
        t = torch.empty(p.shape, dtype=dtype, device=on)
        if name.endswith("A_log"):
            t.uniform_(1, 16).log_()
        elif name.endswith("dt_bias") or (name.endswith("norm.weight") and "linear_attn" in name):
            t.fill_(1.0)
        elif "norm" in name:
            t.fill_(0.0 if cfg.zero_centered_norm else 1.0)
        elif on == "cpu":
            random_fill_(t, 0.02, seed=hash(name) % 2**31)
        else:
            t.normal_(0, 0.02)
        mod_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, torch.nn.Parameter(t, requires_grad=False))
    for b in model.moe_blocks():
        assert isinstance(b.experts, FusedExperts)
    return model.eval().fuse_projections()
