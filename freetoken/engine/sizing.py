"""Engine sizes chosen when no flag gives them: the KV pool from the memory left after the
weights (and the slot cache), and the prefill chunk from the expert runtime's streamer."""
from __future__ import annotations

import os

import torch

from freetoken.cache.tensors import KVPool
from freetoken.log import get_logger, kv
from freetoken.types.config import WORKSPACE_MARGIN_BYTES

log = get_logger("engine")
# prefill chunk when long chunks stream whole MoE layers (see default_chunk_tokens)
STREAM_CHUNK_TOKENS = 8192


def kv_pool_tokens(max_context: int, bytes_per_token: int, device_type: str, free_bytes: int,
                   reserve_tokens: int | None = None) -> int:
    """KV pool size in tokens when `--kv-tokens` is not given: the whole context if memory allows,
    never under 1024. `free_bytes` is what is free now, after the weights (and the slot cache).

    CPU: a quarter of the available RAM. CUDA, all experts on the device: 90% of the free memory.
    CUDA with a slot cache (`reserve_tokens` given): `--kv-reserve-tokens` is a floor (DESIGN §4):
    the slot cache was sized to leave it plus the workspace margin free, and KV also takes any
    memory the cache left beyond that (a small `--moe-cache-size`), keeping the same margin."""
    if device_type == "cuda":
        if reserve_tokens is not None:
            budget = max(reserve_tokens * bytes_per_token, free_bytes - WORKSPACE_MARGIN_BYTES)
        else:
            budget = int(free_bytes * 0.9)
    else:
        budget = free_bytes // 4
    return max(1024, min(max_context, budget // max(1, bytes_per_token)))


def default_kv_tokens(model, max_context: int, moe) -> int:
    """`kv_pool_tokens` for a loaded model on its device; logs the decision."""
    w = model.model.embed_tokens.weight
    per_tok = max(1, KVPool.bytes_per_token(model.cfg, w.dtype))
    if w.device.type == "cuda":
        free = int(torch.cuda.mem_get_info(w.device)[0])
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    reserve = moe.kv_reserve_tokens if moe is not None and moe.backend != "fused" else None
    n = kv_pool_tokens(max_context, per_tok, w.device.type, free, reserve)
    log.info(kv("kv_pool_size", tokens=n, max_context=max_context, bytes_per_token=per_tok,
                mb=n * per_tok // 2**20, floor_tokens=reserve))
    return n


def default_chunk_tokens(moe) -> int:
    """Prefill tokens per step when `--chunk-tokens` is not given: 8192 when long chunks stream
    whole MoE layers through the expert runtime `moe`'s streamer (a streamed chunk costs one
    pass of the layer's misses over the link however many tokens it carries, so the chunk is
    made large: DESIGN §4), else 512."""
    st = moe.streamer if moe is not None else None
    if st is not None and st.wants(STREAM_CHUNK_TOKENS)[0]:
        return STREAM_CHUNK_TOKENS
    return 512
