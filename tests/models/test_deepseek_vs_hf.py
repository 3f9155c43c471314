"""DeepSeek-V3 (MLA + group-limited routing) against transformers' `deepseek_v3` (the oracle),
through the real checkpoint path (save_pretrained → load_model): logits of the plain prefill
form and of the absorbed decode form (greedy tokens and the batched engine with prefix reuse:
test_families_vs_hf.py), and the config, rotary and router pieces on their own."""
from __future__ import annotations

import json

import pytest
import torch

from freetoken.cache.tensors import Caches, KVPool
from freetoken.models.loader import load_model
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ConfigError, config_from_dict, load_config
from tests.models.family_helpers import prompt, rel
from tests.models.fixtures import hf_reference

KINDS = ["deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3_old_spelling"]
REL = 1e-5


def _pool(model, n: int) -> Caches:
    return Caches(KVPool(model.cfg, n, torch.float32, "cpu"), None)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_logits_match_transformers(tiny_hf, kind: str) -> None:
    """Plain form (prefill chunks, with a cached prefix) and absorbed form (every decode row)
    each equal transformers. Positions run past YaRN's original 128 (the ramp's far side)."""
    d = tiny_hf(kind)
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    ids = prompt(ours.cfg.vocab_size, 150)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # [T, V]
    got = ours(ForwardBatch.single(ids, 0, torch.arange(150), None, all_logits=True),
               _pool(ours, 256))
    assert rel(got, want) <= REL
    c = _pool(ours, 256)
    parts = [ours(ForwardBatch.single(ids[:97], 0, torch.arange(97), None, all_logits=True), c)]
    parts.append(ours(ForwardBatch.single(ids[97:140], 97, torch.arange(140), None,
                                          all_logits=True), c))
    parts += [ours(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), None), c)
              for t in range(140, 150)]
    assert rel(torch.cat(parts), want) <= REL
    # the absorbed form alone, from the first token: every row a decode row
    c = _pool(ours, 256)
    dec = torch.cat([ours(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), None), c)
                     for t in range(40)])
    assert rel(dec, want[:40]) <= REL


def test_pool_holds_one_latent_per_token(tiny_hf) -> None:
    """The radix cache's slots index latents: [S, 1, kv_lora_rank + rope] per layer, no V; a
    pool sized per head (Hq × head_dim K and V) would be the bug this catches."""
    ours = load_model(tiny_hf("deepseek_v3"), dtype=torch.float32, progress=False)
    cfg = ours.cfg
    pool = KVPool(cfg, 10, torch.float32, "cpu")
    assert len(pool.k) == cfg.num_layers
    assert pool.k[0].shape == (10, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim) == (10, 1, 64)
    assert pool.v[0].numel() == 0
    assert KVPool.bytes_per_token(cfg, torch.bfloat16) == cfg.num_layers * 64 * 2


def test_long_context_decode_reads_latents_in_place(tiny_hf, monkeypatch) -> None:
    """Decode rows past MIN_KEYS go through the C++ decode kernel over the latent pool
    (k_pool = v_pool = latents, one KV head) from scattered slots; logits still match."""
    import freetoken.kernels.cpu.attention_ops as ao

    calls: list[bool] = []
    real = ao.cpu_decode_attention

    def spy(*a, **k):
        r = real(*a, **k)
        calls.append(r is not None)
        return r

    monkeypatch.setattr("freetoken.layers.mla.cpu_decode_attention", spy)
    d = tiny_hf("deepseek_v3")
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    n = ao.MIN_KEYS + 6
    ids = prompt(ours.cfg.vocab_size, n, seed=3)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -4:]  # [4, V]
    c = _pool(ours, 2 * n)
    slots = torch.randperm(2 * n, generator=torch.Generator().manual_seed(0))[:n]
    ours(ForwardBatch.single(ids[:-4], 0, slots[: n - 4], None), c)
    got = torch.cat([ours(ForwardBatch.single([ids[t]], t, slots[: t + 1], None), c)
                     for t in range(n - 4, n)])
    assert any(calls), "the in-place kernel must have served the long decode rows"
    assert rel(got, want) <= REL


def test_config_spellings_and_defaults(tiny_hf) -> None:
    new, old = load_config(tiny_hf("deepseek_v3")), load_config(tiny_hf("deepseek_v3_old_spelling"))
    assert new == old  # rope_scaling + top-level rope_theta reads as rope_parameters
    assert dict(new.rope_scaling)["rope_type"] == "yarn" and new.rope_theta == 10000.0
    assert new.mlp_only_layers == (0,) and new.moe_layers == [1, 2]
    assert new.shared_expert_intermediate_size == 2 * 32 and not new.shared_expert_gated
    assert (new.n_group, new.topk_group, new.routed_scaling_factor) == (4, 2, 2.5)
    assert load_config(tiny_hf("deepseek_v3_no_q_lora")).q_lora_rank == 0  # null: q_proj
    # absent fields take transformers' defaults, as the oracle reads them
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config()
    cfg = config_from_dict({"model_type": "deepseek_v3", "vocab_size": 1000, "hidden_size": 64,
                            "num_hidden_layers": 4, "num_attention_heads": 4})
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.num_experts, cfg.n_group, cfg.topk_group,
            cfg.top_k, cfg.routed_scaling_factor, cfg.rope_interleave) == (
        hf.q_lora_rank, hf.kv_lora_rank, hf.n_routed_experts, hf.n_group, hf.topk_group,
        hf.num_experts_per_tok, hf.routed_scaling_factor, hf.rope_interleave)
    assert cfg.mlp_only_layers == tuple(range(hf.first_k_dense_replace))


@pytest.mark.parametrize("bad,word", [({"scoring_func": "softmax"}, "scoring_func"),
                                      ({"n_group": 3}, "n_group"),
                                      ({"topk_group": 9}, "topk_group"),
                                      ({"rope_scaling": {"type": "llama3", "factor": 8}}, "llama3"),
                                      ({"hidden_act": "gelu"}, "gelu"),
                                      ({"quantization_config": {"quant_method": "fp8",
                                                                "weight_block_size": [128, 128]}},
                                       "fp8")])
def test_unsupported_config_is_refused(tiny_hf, bad: dict, word: str) -> None:
    raw = json.loads((tiny_hf("deepseek_v3") / "config.json").read_text())
    raw.pop("rope_parameters", None) if "rope_scaling" in bad else None
    raw.update(bad)
    with pytest.raises(ConfigError, match=word):
        config_from_dict(raw)


def test_bf16_keeps_the_router_in_fp32(tiny_hf) -> None:
    """Bug caught: the reader cast the correction bias to bf16 with everything else (transformers
    keeps router weight and bias in fp32), which moves expert choices; the bf16 model stays
    close to the fp32 oracle."""
    from safetensors import safe_open

    d = tiny_hf("deepseek_v3")
    ours, ref = load_model(d, dtype=torch.bfloat16, progress=False), hf_reference(d)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        for b in ours.moe_blocks():
            p = f"model.layers.{b.layer_id}.mlp.gate."
            assert b.gate.weight.dtype == b.gate.e_score_correction_bias.dtype == torch.float32
            bias = f.get_tensor(p + "e_score_correction_bias")
            assert torch.equal(b.gate.e_score_correction_bias, bias)
            assert torch.equal(b.gate.weight, f.get_tensor(p + "weight"))
    assert ours.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    ids = prompt(ours.cfg.vocab_size, 70, seed=2)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    c = Caches(KVPool(ours.cfg, 128, torch.bfloat16, "cpu"), None)
    got = ours(ForwardBatch.single(ids, 0, torch.arange(70), None, all_logits=True), c)
    assert (got - want).norm() / want.norm() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_preset_is_the_published_model() -> None:
    """`--shape deepseek-v3`: the tensors of the preset total DeepSeek-V3's published 671B
    parameters (MTP module excluded), 37B of them active per token."""
    import math

    from freetoken.checkpoint.layout import expected_tensors
    from freetoken.types.presets import preset_config

    cfg = preset_config("deepseek-v3")
    shapes = expected_tensors(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for k, s in shapes.items() if ".experts." in k)
    active = total - experts * (1 - cfg.top_k / cfg.num_experts)
    assert round(total / 1e9) == 671 and round(active / 1e9) in (37, 38)
    cut = preset_config("deepseek-v3", layers=5)
    assert cut.moe_layers == [3, 4] and cut.kv_entry == (1, 576, 0)
    with pytest.raises(ValueError, match="no MoE layer; the first MoE layer is layer 3"):
        preset_config("deepseek-v3", layers=3)
