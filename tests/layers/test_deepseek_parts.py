"""DeepSeek-V3's router and YaRN rotary against transformers' modules on their own, at the
published checkpoint's settings (the tiny model tests cover them only at tiny sizes)."""
from __future__ import annotations

import torch

from freetoken.layers.rope_scaling import YarnRotary
from freetoken.layers.routing import GroupLimitedRouter
from freetoken.types.presets import preset_config


def test_router_matches_transformers_at_the_real_grouping() -> None:
    """256 experts in 8 groups, 4 groups kept, top-8 (DeepSeek-V3): same experts and weights
    as transformers' DeepseekV3TopkRouter for 300 tokens, with a non-zero correction bias."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    g = torch.Generator().manual_seed(0)
    hf_cfg = DeepseekV3Config(hidden_size=64)
    ref = DeepseekV3TopkRouter(hf_cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(256, 64, generator=g) * 0.1)
        ref.e_score_correction_bias.copy_(torch.randn(256, generator=g) * 0.05)
    ours = GroupLimitedRouter(64, 256, 8, 8, 4, True, 2.5)
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(300, 64, generator=g)
    _, w_ref, ids_ref = ref(x)
    w, ids = ours(x)
    o_ref, o = ids_ref.sort(-1), ids.sort(-1)
    assert torch.equal(o.values, o_ref.values)
    assert torch.allclose(w.gather(1, o.indices), w_ref.gather(1, o_ref.indices), rtol=1e-6)
    # the kept experts come from at most topk_group groups of 32
    assert int((ids // 32).unique(dim=None).numel()) <= 8
    assert all(len(set((r // 32).tolist())) <= 4 for r in ids)
    masked = ours(x, row_mask=torch.arange(300) % 2 == 0)[1]
    assert bool((masked[1::2] == -1).all()) and torch.equal(masked[::2], ids[::2])


def test_yarn_rotary_matches_transformers_at_the_real_shape() -> None:
    """factor 40 over 4096 pretraining positions, 64 rope dims, mscale = mscale_all_dim = 1
    (DeepSeek-V3's config): cos/sin at positions to 160k equal transformers'."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    cfg = preset_config("deepseek-v3", layers=4)
    rs = dict(cfg.rope_scaling)
    hf_cfg = DeepseekV3Config(rope_parameters={"rope_theta": cfg.rope_theta, **rs},
                              max_position_embeddings=cfg.max_position_embeddings)
    ref = DeepseekV3RotaryEmbedding(hf_cfg)
    ours = YarnRotary(cfg.rotary_dim, cfg.rope_theta, rs, cfg.max_position_embeddings)
    pos = torch.tensor([0, 1, 17, 4095, 4096, 50_000, 163_839])
    c_ref, s_ref = ref(torch.zeros(1, dtype=torch.float32), pos[None])
    c, s = ours.cos_sin(pos, torch.float32)
    assert torch.allclose(c, c_ref[0], atol=1e-6) and torch.allclose(s, s_ref[0], atol=1e-6)
    assert ref.attention_scaling == ours.attention_factor == 1.0
