"""The output head computed over its distinct rows only (`QwenMoE.dedup_output_head`): the
trained demo's 151,680 ids share 6,645 rows, so a decode step reads 1/23 of the head. Oracle:
the same model's full head (`small_linear` over every row) for the logits, and its greedy
tokens; a random checkpoint's head (all rows distinct) is left as it is."""
from __future__ import annotations

import json

import torch

from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.engine.generate import generate
from freetoken.models.demo import resolve_model_path
from freetoken.models.demo_trained import WEIGHTS_DIR
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.forward_batch import ForwardBatch


def _logits(model, ids: list[int]) -> torch.Tensor:
    cfg = model.cfg
    c = Caches(KVPool(cfg, len(ids) + 8, torch.float32, "cpu"),
               StateTensors(cfg, 1, torch.float32, "cpu"))
    return model(ForwardBatch.single(ids, 0, torch.arange(len(ids)), 0, all_logits=True), c)


def test_demo_head_is_deduplicated_and_gives_the_full_heads_logits_and_tokens() -> None:
    model = load_model(resolve_model_path("demo"), dtype=torch.float32, progress=False)
    used = json.loads((WEIGHTS_DIR / "manifest.json").read_text())["used_ids"]
    assert model.head_rows is not None and model.head_rows.shape[0] == used + 1  # + shared row
    ids = [151644, 872, 198, 9707, 1879, 151645, 198, 151644, 77091, 198]
    got = _logits(model, ids)
    rows, index = model.head_rows, model.head_index
    model.head_rows = model.head_index = None  # the full head: every row read
    want = _logits(model, ids)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want_toks = generate(model, ids, sp, []).token_ids
    model.head_rows, model.head_index = rows, index
    assert got.shape == want.shape == (len(ids), model.cfg.vocab_size)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert generate(model, ids, sp, []).token_ids == want_toks


def test_a_head_of_distinct_rows_is_left_alone(tiny_hf) -> None:
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    assert model._buffers.get("head_index") is None
    assert model.dedup_output_head() is None


def test_a_head_of_few_rows_is_grouped_exactly(tiny_hf) -> None:
    """Any head with at most half its rows distinct, not only the demo's: five row values
    spread over the vocabulary give five groups, each id its own row's logits."""
    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    w = model.output_embedding()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w.copy_(torch.randn(5, w.shape[1], generator=g)[torch.randint(0, 5, (w.shape[0],),
                                                                       generator=g)])
    ids = list(range(3, 19))
    want = _logits(model, ids)
    assert model.dedup_output_head() == 5
    assert torch.equal(model.head_rows[model.head_index], w)
    got = _logits(model, ids)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and torch.equal(got.argmax(-1),
                                                                            want.argmax(-1))
