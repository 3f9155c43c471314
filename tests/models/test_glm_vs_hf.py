"""GLM-5 (`glm_moe_dsa`: MLA + DeepSeek sparse attention + group-limited routing) against
transformers' `glm_moe_dsa` (the oracle), through the real checkpoint path: logits of the plain
prefill form, chunked prefill over a cached prefix, the absorbed decode form and decode over
scattered pool slots, with prompts longer than `index_topk` so the indexer's choice matters
(greedy tokens, the batched engine and every expert backend: test_families_vs_hf.py,
tests/engine/test_deepseek_backends.py); the config, the pool entry and the preset."""
from __future__ import annotations

import json
import math

import pytest
import torch

from freetoken.cache.tensors import Caches, KVPool
from freetoken.models.loader import load_model
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import ConfigError, config_from_dict, load_config
from tests.models.family_helpers import prompt, rel
from tests.models.fixtures import hf_reference

REL = 1e-5


def _pool(model, n: int, dtype: torch.dtype = torch.float32) -> Caches:
    return Caches(KVPool(model.cfg, n, dtype, "cpu"), None)


def _whole(model, ids: list[int], slots: torch.Tensor | None = None) -> torch.Tensor:
    n = len(ids)
    slots = torch.arange(n) if slots is None else slots
    return model(ForwardBatch.single(ids, 0, slots, None, all_logits=True), _pool(model, 2 * n))


@pytest.mark.parametrize("kind", ["glm_moe_dsa", "glm_moe_dsa_yarn"])
def test_prefill_and_decode_logits_match_transformers(tiny_hf, kind: str) -> None:
    d = tiny_hf(kind)
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    assert ours.cfg.index_topk == 24
    ids = prompt(ours.cfg.vocab_size, 150)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # [T, V]
    assert rel(_whole(ours, ids), want) <= REL
    c = _pool(ours, 256)
    parts = [ours(ForwardBatch.single(ids[:97], 0, torch.arange(97), None, all_logits=True), c)]
    parts.append(ours(ForwardBatch.single(ids[97:140], 97, torch.arange(140), None,
                                          all_logits=True), c))
    parts += [ours(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), None), c)
              for t in range(140, 150)]
    assert rel(torch.cat(parts), want) <= REL
    # every row a decode row, from the first token: the absorbed form over the picked latents
    c = _pool(ours, 256)
    dec = torch.cat([ours(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), None), c)
                     for t in range(60)])
    assert rel(dec, want[:60]) <= REL


def test_sparse_choice_matters_and_is_shared(tiny_hf, monkeypatch) -> None:
    """The oracle would not notice an indexer that picked every key if prompts were shorter
    than index_topk: here dense attention differs from transformers by far more than REL, and
    so does a shared layer that attended densely instead of reusing the full layer's pick."""
    from freetoken.layers.dsa import SparseMLAttention

    d = tiny_hf("glm_moe_dsa")
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    ids = prompt(ours.cfg.vocab_size, 100, seed=4)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert rel(_whole(ours, ids), want) <= REL
    attn = [layer.self_attn for layer in ours.model.layers]
    assert isinstance(attn[1], SparseMLAttention) and attn[1].indexer is None
    for a in attn:
        if a.indexer is not None:
            monkeypatch.setattr(a.indexer, "topk", 10_000)
    assert rel(_whole(ours, ids), want) > 1e-3
    monkeypatch.undo()
    real = SparseMLAttention.forward

    def dense_when_shared(self, x, cos, sin, batch, kv):
        if self.indexer is None:
            self._share.picks = [None] * batch.num_seqs
        return real(self, x, cos, sin, batch, kv)

    monkeypatch.setattr(SparseMLAttention, "forward", dense_when_shared)
    assert rel(_whole(ours, ids), want) > 1e-3


def test_decode_over_scattered_slots(tiny_hf) -> None:
    """Latents and indexer keys read back from scattered pool slots (the radix cache's): the
    picked slots are slot ids, not positions."""
    d = tiny_hf("glm_moe_dsa")
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    n = 90
    ids = prompt(ours.cfg.vocab_size, n, seed=3)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -6:]
    c = _pool(ours, 3 * n)
    slots = torch.randperm(3 * n, generator=torch.Generator().manual_seed(0))[:n]
    ours(ForwardBatch.single(ids[:-6], 0, slots[: n - 6], None), c)
    got = torch.cat([ours(ForwardBatch.single([ids[t]], t, slots[: t + 1], None), c)
                     for t in range(n - 6, n)])
    assert rel(got, want) <= REL


def test_device_pick_equals_the_per_row_pick(tiny_hf) -> None:
    """The runner's device pick (`pick_csr`, over a whole CSR of scattered slots, with stale
    entries past its end) keeps the same slots per row as the per-row pick."""
    from freetoken.layers.dsa import pick_csr

    ix = load_model(tiny_hf("glm_moe_dsa"), dtype=torch.float32,
                    progress=False).model.layers[0].self_attn.indexer
    g = torch.Generator().manual_seed(2)
    S, lens = 300, [5, 24, 25, 90]
    ipool = torch.randn(S, 1, ix.di, generator=g)
    perm = torch.randperm(S, generator=g)
    rows = [perm[sum(lens[:b]):sum(lens[:b + 1])] for b in range(len(lens))]
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([*rows, perm[:7]]).to(torch.int32)  # 7 stale entries past the end
    q = torch.randn(len(lens), ix.hi, ix.di, generator=g)
    w = torch.randn(len(lens), ix.hi, generator=g)
    ptr, idx = pick_csr(ix, q, w, ipool, indptr, indices)
    for b, slots in enumerate(rows):
        want = ix.pick_slots(q[b:b + 1], w[b:b + 1], ipool[slots, 0], slots)
        got = idx[ptr[b]:ptr[b + 1]].long()
        assert len(got) == min(lens[b], ix.topk)
        assert sorted(got.tolist()) == sorted(want.tolist()), b


def test_pool_entry_is_latent_and_indexer_key(tiny_hf) -> None:
    cfg = load_config(tiny_hf("glm_moe_dsa"))
    pool = KVPool(cfg, 10, torch.float32, "cpu")
    assert cfg.kv_entry == (1, 48 + 16, 32)
    assert pool.k[0].shape == (10, 1, 64) and pool.v[0].shape == (10, 1, 32)
    assert KVPool.bytes_per_token(cfg, torch.bfloat16) == 4 * (64 + 32) * 2


def test_config_spellings_and_defaults(tiny_hf) -> None:
    from transformers import GlmMoeDsaConfig

    new = load_config(tiny_hf("glm_moe_dsa"))
    assert new == load_config(tiny_hf("glm_moe_dsa_freq_spelling"))
    assert new.indexer_types == ("full", "shared", "full", "shared")
    assert (new.index_topk, new.index_head_dim, new.index_n_heads) == (24, 32, 8)
    assert new.mlp_only_layers == (0,) and new.moe_layers == [1, 2, 3] and new.rope_interleave
    # absent fields read as transformers reads them
    hf = GlmMoeDsaConfig(num_hidden_layers=6, index_topk_freq=3, index_skip_topk_offset=1)
    cfg = config_from_dict({"model_type": "glm_moe_dsa", "hidden_size": 64,
                            "num_hidden_layers": 6, "num_attention_heads": 4,
                            "index_topk_freq": 3, "index_skip_topk_offset": 1,
                            "vocab_size": hf.vocab_size})
    assert cfg.indexer_types == tuple(hf.indexer_types) == ("full", "shared", "shared", "full",
                                                            "shared", "shared")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim, cfg.qk_nope_head_dim,
            cfg.n_group, cfg.topk_group, cfg.num_experts, cfg.top_k, cfg.index_topk,
            cfg.index_head_dim, cfg.index_n_heads, cfg.rms_norm_eps) == (
        hf.q_lora_rank, hf.kv_lora_rank, hf.v_head_dim, hf.qk_nope_head_dim, hf.n_group,
        hf.topk_group, hf.n_routed_experts, hf.num_experts_per_tok, hf.index_topk,
        hf.index_head_dim, hf.index_n_heads, hf.rms_norm_eps)
    assert cfg.mlp_only_layers == tuple(i for i, t in enumerate(hf.mlp_layer_types)
                                        if t == "dense")
    pattern = config_from_dict({**json.loads((tiny_hf("glm_moe_dsa") / "config.json")
                                             .read_text()), "indexer_types": None,
                                "index_topk_pattern": "FFSF"})
    assert pattern.indexer_types == ("full", "full", "shared", "full")


@pytest.mark.parametrize("bad,word", [({"q_lora_rank": None}, "q_lora_rank"),
                                      ({"indexer_types": ["shared", "full", "full", "full"]},
                                       "indexer_types"),
                                      ({"indexer_types": ["full", "full"]}, "indexer_types"),
                                      ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]},
                                       "mlp_layer_types"),
                                      ({"scoring_func": "softmax"}, "glm_moe_dsa: routing")])
def test_unsupported_config_is_refused(tiny_hf, bad: dict, word: str) -> None:
    raw = json.loads((tiny_hf("glm_moe_dsa") / "config.json").read_text())
    raw.update(bad)
    with pytest.raises(ConfigError, match=word):
        config_from_dict(raw)


def test_bf16_keeps_router_and_indexer_weights_in_fp32(tiny_hf) -> None:
    d = tiny_hf("glm_moe_dsa")
    ours, ref = load_model(d, dtype=torch.bfloat16, progress=False), hf_reference(d)
    ix = ours.model.layers[0].self_attn.indexer
    assert ix.weights_proj.weight.dtype == torch.float32 and ix.wq_b.weight.dtype == torch.bfloat16
    assert all(b.gate.weight.dtype == torch.float32 for b in ours.moe_blocks())
    ids = prompt(ours.cfg.vocab_size, 70, seed=2)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = ours(ForwardBatch.single(ids, 0, torch.arange(70), None, all_logits=True),
               _pool(ours, 128, torch.bfloat16))
    assert (got - want).norm() / want.norm() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_preset_is_the_published_model() -> None:
    """`--shape glm-5`: GLM-5's 744B parameters (MTP layer excluded), about 40B active."""
    from freetoken.checkpoint.layout import expected_tensors
    from freetoken.types.presets import preset_config

    cfg = preset_config("glm-5")
    shapes = expected_tensors(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for k, s in shapes.items() if ".experts." in k)
    active = total - experts * (1 - cfg.top_k / cfg.num_experts)
    assert round(total / 1e9) == 744 and 40 <= active / 1e9 < 43
    cut = preset_config("glm-5", layers=4)
    assert cut.moe_layers == [3] and cut.kv_entry == (1, 576, 128)
    with pytest.raises(ValueError, match="no MoE layer; the first MoE layer is layer 3"):
        preset_config("glm-5", layers=3)


def test_bench_checkpoint_loads_in_transformers_and_here(tmp_path) -> None:
    """`ft bench checkpoint --shape tiny-glm-5` writes GLM-5's released layout: transformers
    loads it as GlmMoeDsaForCausalLM and our logits equal its."""
    from transformers import AutoModelForCausalLM

    from freetoken.bench.checkpoint_writer import write_checkpoint

    d = write_checkpoint("tiny-glm-5", None, tmp_path / "ck", progress=False)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert type(ref).__name__ == "GlmMoeDsaForCausalLM"
    ours = load_model(d, dtype=torch.float32, progress=False)
    ids = prompt(ours.cfg.vocab_size, 40, seed=5)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert rel(_whole(ours, ids), want) <= REL
