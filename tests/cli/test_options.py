"""Engine flag parsing: sizes, dtypes, the default MoE backend and the KV pool default."""
from __future__ import annotations

import argparse

import pytest
import torch

from freetoken.cli.options import (
    _size,
    add_cache_args,
    add_moe_args,
    default_backend,
    moe_options,
    resolve_dtype,
)
from freetoken.types.presets import preset_config


def test_sizes_and_dtypes() -> None:
    assert _size("12GiB") == 12 * 2**30 and _size("1.5G") == 1_500_000_000
    assert _size("512MiB") == 512 * 2**20 and _size("4096") == 4096
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("auto") is None
    with pytest.raises(SystemExit):
        resolve_dtype("int4")


# Qwen3.6-35B-A3B in bf16, by hand: 40 MoE layers x 256 experts x 3*2048*512 weights x 2 bytes,
# and K+V of 10 full-attention layers x 2 KV heads x 256 dims x 2 bytes per token.
QWEN36_EXPERT_BYTES = 40 * 256 * 3 * 2048 * 512 * 2  # 64.4 GB
QWEN36_KV_BYTES_PER_TOKEN = 2 * 10 * 2 * 256 * 2  # 20 KiB


def test_default_backend_is_fused_only_when_everything_fits(monkeypatch) -> None:
    """On a GPU: `fused` when the experts, the rest of the model and the KV floor fit in 90% of
    the free memory, else `auto`; on the CPU always `fused` (host RAM holds the experts anyway)."""
    cfg = preset_config("qwen3.6-35b-a3b")
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 0))

    def choice(free_bytes: float, reserve: int = 8192) -> str:
        free["bytes"] = int(free_bytes)
        return default_backend(cfg, torch.bfloat16, "cuda", reserve)

    assert choice(QWEN36_EXPERT_BYTES * 0.9) == "auto"  # not even the experts fit
    assert choice(2 * QWEN36_EXPERT_BYTES) == "fused"
    # find the smallest free memory that still gives fused, then show the KV floor counts
    lo, hi = QWEN36_EXPERT_BYTES, 2 * QWEN36_EXPERT_BYTES
    while hi - lo > 2**20:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if choice(mid) == "fused" else (mid, hi)
    assert hi > QWEN36_EXPERT_BYTES / 0.9  # the experts alone need more than that
    floor_tokens = 4 * 2**30 // QWEN36_KV_BYTES_PER_TOKEN  # a 4 GiB floor
    assert choice(hi + 2**20, 8192) == "fused" and choice(hi + 2**20, floor_tokens) == "auto"
    assert choice(hi + 2**20 + 4 * 2**30 / 0.9, floor_tokens) == "fused"
    assert default_backend(cfg, torch.bfloat16, "cpu", 8192) == "fused"


def test_moe_flags_reach_the_options() -> None:
    p = argparse.ArgumentParser()
    add_moe_args(p)
    add_cache_args(p)
    a = p.parse_args(["--moe-cache-rate", "0.37", "--moe-cpu-layers", "2",
                      "--kv-reserve-tokens", "100", "--moe-hybrid-max-fetch", "3"])
    assert a.moe_backend is None  # resolved at load time, by default_backend
    o = moe_options(a, "auto")
    assert (o.backend, o.cache_rate, o.cpu_layers, o.kv_reserve_tokens, o.hybrid_max_fetch) == (
        "auto", 0.37, 2, 100, 3)
    assert moe_options(p.parse_args(["--moe-backend", "hybrid"])).backend == "hybrid"
    assert moe_options(p.parse_args(["--moe-cache-mem", "2GiB"]), "cpu").cache_mem == 2 * 2**30
    with pytest.raises(ValueError):
        moe_options(p.parse_args(["--moe-cache-rate", "1.5"]))


def test_kv_pool_tokens_reserve_is_a_floor() -> None:
    """`--kv-reserve-tokens` is a floor (DESIGN §4), not a ceiling: with a slot cache on the GPU,
    KV gets at least the floor and any memory the cache left beyond it, less the workspace
    margin. Bug it catches: the pool was sized to exactly the floor, wasting the rest of VRAM."""
    from freetoken.engine.sizing import kv_pool_tokens
    from freetoken.types.config import WORKSPACE_MARGIN_BYTES as M

    per, ctx = 1000, 10**6
    assert kv_pool_tokens(ctx, per, "cuda", 8192 * per + M, 8192) == 8192
    assert kv_pool_tokens(ctx, per, "cuda", 50_000 * per + M, 8192) == 50_000
    assert kv_pool_tokens(ctx, per, "cuda", 100 * per, 8192) == 8192  # floor kept when short
    assert kv_pool_tokens(ctx, per, "cuda", 50_000 * per) == 45_000  # fused: 90% of free
    assert kv_pool_tokens(ctx, per, "cpu", 40_000 * per) == 10_000  # a quarter of the RAM
    assert kv_pool_tokens(4096, per, "cpu", 10**12) == 4096  # never more than the context
    assert kv_pool_tokens(ctx, per, "cpu", 0) == 1024  # never under 1024


def test_kv_reserved_for_the_context_before_the_slot_cache(tiny_hf) -> None:
    """Non-fused on a GPU: the slot cache is sized to leave the whole context's K/V free (the
    model's, or --max-context), never less than the --kv-reserve-tokens floor; the KV pool then
    gets the context, not just the floor (bug: W3/W4-sized prompts refused at 8192 tokens)."""
    import argparse

    from freetoken.cache.tensors import KVPool
    from freetoken.cli.options import add_moe_args, moe_from_args
    from freetoken.engine.sizing import kv_pool_tokens
    from freetoken.types.model_config import load_config

    d = tiny_hf("qwen3_5_moe")
    cfg = load_config(d)
    per = KVPool.bytes_per_token(cfg, torch.bfloat16)
    p = argparse.ArgumentParser()
    add_moe_args(p)
    p.add_argument("--max-context", type=int, default=None)
    for argv, want in (([], max(8192, cfg.max_position_embeddings)),
                       (["--max-context", "40000"], 40000),
                       (["--max-context", "100", "--kv-reserve-tokens", "300"], 300)):
        args = p.parse_args(["--moe-backend", "offload", *argv])
        moe, reserve = moe_from_args(args, d, torch.bfloat16, "cuda")
        assert reserve == want * per, argv
        # what the slot cache leaves (the reserve plus the workspace margin) is the KV pool
        ctx = args.max_context or cfg.max_position_embeddings
        free = reserve + (1 << 30)
        assert kv_pool_tokens(ctx, per, "cuda", free, moe.kv_reserve_tokens) == max(
            min(ctx, want), 1024)
    # fused: no slot cache, the pool takes 90 % of what is free after the weights
    assert kv_pool_tokens(50_000, per, "cuda", 10_000 * per, None) == 9000
