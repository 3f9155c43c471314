"""Kimi-Linear (Kimi Delta Attention + NoPE MLA + group-limited MoE) against transformers'
`kimi_linear` (the oracle), through save_pretrained → load_model: logits of the chunked KDA
prefill and of the recurrent decode (greedy tokens and the batched engine with prefix reuse
over KDA state snapshots: test_families_vs_hf.py); and the KDA rule against a float64
recurrence written out step by step."""
from __future__ import annotations

import pytest
import torch

from freetoken.layers.kda_rule import chunk_kda, recurrent_kda
from freetoken.models.loader import load_model
from freetoken.types.forward_batch import ForwardBatch
from freetoken.types.model_config import load_config
from tests.models.family_helpers import caches, prompt, rel
from tests.models.fixtures import hf_reference

REL = 1e-5


@pytest.mark.parametrize("kind", ["kimi_linear", "kimi_linear_published_spelling"])
def test_logits_match_transformers(tiny_hf, kind: str) -> None:
    """150 tokens: more than two 64-token KDA chunks, not a multiple; then chunked prefill with
    carried conv / KDA state and token-by-token decode; then every row a decode row."""
    d = tiny_hf(kind)
    ours, ref = load_model(d, dtype=torch.float32, progress=False), hf_reference(d)
    ids = prompt(ours.cfg.vocab_size, 150)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = ours(ForwardBatch.single(ids, 0, torch.arange(150), 0, all_logits=True),
               caches(ours, 256))
    assert rel(got, want) <= REL
    c = caches(ours, 256)
    parts = [ours(ForwardBatch.single(ids[:97], 0, torch.arange(97), 0, all_logits=True), c)]
    parts.append(ours(ForwardBatch.single(ids[97:140], 97, torch.arange(140), 0,
                                          all_logits=True), c))
    parts += [ours(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), 0), c)
              for t in range(140, 150)]
    assert rel(torch.cat(parts), want) <= REL
    c = caches(ours, 256)
    dec = torch.cat([ours(ForwardBatch.single([ids[t]], t, torch.arange(t + 1), 0), c)
                     for t in range(30)])
    assert rel(dec, want[:30]) <= REL


def test_config_reads_the_published_spelling(tiny_hf) -> None:
    a = load_config(tiny_hf("kimi_linear"))
    b = load_config(tiny_hf("kimi_linear_published_spelling"))
    assert a == b
    assert a.linear_attention_layers == [0, 2, 3] and a.full_attention_layers == [1, 4]
    assert a.mlp_only_layers == (0,) and a.kv_entry == (1, 64, 0) and not a.mla_rope
    assert (a.linear_num_key_heads, a.linear_key_head_dim, a.linear_conv_dim) == (2, 16, 96)


def _kda_reference(q, k, v, g, beta, state):
    """The recurrence of freetoken/layers/kda_rule.py's docstring, one token at a time in
    float64. q, k [n, H, K] (normalised); v [n, H, V]; g [n, H, K]; beta [n, H]."""
    s = state.double().clone()  # [H, K, V]
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[..., None]
        kt, qt = k[t].double(), q[t].double() / q.shape[-1] ** 0.5
        delta = (v[t].double() - torch.einsum("hkv,hk->hv", s, kt)) * beta[t].double()[:, None]
        s = s + kt[..., None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, qt))
    return torch.stack(out), s


@pytest.mark.parametrize("n", [1, 63, 64, 150])
def test_kda_rule_chunked_and_recurrent_against_float64(n: int) -> None:
    g0 = torch.Generator().manual_seed(n)
    H, K, V = 3, 16, 8

    def r(*s):
        return torch.randn(*s, generator=g0)

    q = torch.nn.functional.normalize(r(n, H, K), dim=-1)
    k = torch.nn.functional.normalize(r(n, H, K), dim=-1)
    v, beta = r(n, H, V), torch.rand(n, H, generator=g0)
    g = -torch.rand(n, H, K, generator=g0) * 2.0  # strong, uneven per-channel decay
    s0 = r(H, K, V)
    want_o, want_s = _kda_reference(q, k, v, g, beta, s0)
    o, s = chunk_kda(q, k, v, g, beta, s0)
    assert torch.allclose(o.double(), want_o, atol=1e-5) and torch.allclose(s.double(), want_s,
                                                                              atol=1e-5)
    st, outs = s0[None], []
    for t in range(n):
        o1, st = recurrent_kda(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], st)
        outs.append(o1)
    assert torch.allclose(torch.cat(outs).double(), want_o, atol=1e-5)
    assert torch.allclose(st[0].double(), want_s, atol=1e-5)


def test_bf16_keeps_router_and_dt_bias_fp32(tiny_hf) -> None:
    d = tiny_hf("kimi_linear")
    ours, ref = load_model(d, dtype=torch.bfloat16, progress=False), hf_reference(d)
    assert all(b.gate.e_score_correction_bias.dtype == torch.float32 for b in ours.moe_blocks())
    assert ours.model.layers[0].self_attn.dt_bias.dtype == torch.float32
    assert ours.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = prompt(ours.cfg.vocab_size, 70, seed=2)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = ours(ForwardBatch.single(ids, 0, torch.arange(70), 0, all_logits=True),
               caches(ours, 128, torch.bfloat16))
    assert (got - want).norm() / want.norm() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_loaded_tensors_equal_transformers(tiny_hf) -> None:
    """Our runtime tensors (the checkpoint's names) against transformers' in-memory ones, which
    rename `block_sparse_moe` to `mlp`, nest the forget gate and fuse the three short convs."""
    from freetoken.checkpoint.safetensors_reader import load_checkpoint

    d = tiny_hf("kimi_linear")
    cfg = load_config(d)
    ours = load_checkpoint(d, cfg, torch.float32, progress=False)
    ref = {k: v.detach() for k, v in hf_reference(d).state_dict().items()}
    mapped: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        hf = name.replace(".block_sparse_moe.", ".mlp.")
        for p in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            hf = hf.replace(f".self_attn.{p}", f".self_attn.forget_gate.{p}")
        if ".q_conv1d." in name:
            hf = hf.replace(".q_conv1d.", ".conv1d.")
            t = torch.cat([t, ours[name.replace("q_conv1d", "k_conv1d")],
                           ours[name.replace("q_conv1d", "v_conv1d")]])
        elif ".k_conv1d." in name or ".v_conv1d." in name:
            continue
        mapped[hf] = t
    assert sorted(mapped) == sorted(ref)
    for name, t in mapped.items():
        assert torch.equal(t, ref[name]), name


def test_preset_is_the_published_size() -> None:
    """`--shape kimi-linear`: Kimi-Linear-48B-A3B's size (49.1B with its 0.75B embedding and LM
    head each, about 3.5B active), KDA and MLA layers 3 : 1, the cut shape keeping one MLA
    layer from 5 layers on."""
    import math

    from freetoken.checkpoint.layout import expected_tensors
    from freetoken.types.presets import preset_config

    cfg = preset_config("kimi-linear")
    shapes = expected_tensors(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for k, s in shapes.items() if ".experts." in k)
    active = total - experts * (1 - cfg.top_k / cfg.num_experts)
    assert 47e9 < total < 50e9 and 3e9 < active < 4e9
    assert cfg.full_attention_layers == [4, 8, 12, 16, 20, 24] and cfg.moe_layers[0] == 1
    cut = preset_config("kimi-linear", layers=5)
    assert cut.full_attention_layers == [4] and cut.kv_entry == (1, 576, 0)
