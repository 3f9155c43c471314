"""What the per-family tests against transformers share (test_model_vs_hf.py for Qwen,
test_deepseek_vs_hf.py, test_kimi_vs_hf.py, test_families_vs_hf.py): seeded prompts, the
relative error, CPU caches sized for a model, and transformers' greedy continuation (the
oracle)."""
from __future__ import annotations

import torch

from freetoken.cache.tensors import Caches, KVPool, StateTensors


def prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    """n token ids drawn uniformly from [0, vocab), the same for the same seed."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((got - want).abs().max() / want.abs().max()).item()


def caches(model, n: int, dtype: torch.dtype = torch.float32) -> Caches:
    """A CPU KV pool of n slots, and 2 state slots when the model has linear attention."""
    cfg = model.cfg
    return Caches(KVPool(cfg, n, dtype, "cpu"),
                  StateTensors(cfg, 2, dtype, "cpu") if cfg.has_linear_attention else None)


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after `ids` (no eos: exactly n)."""
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()
