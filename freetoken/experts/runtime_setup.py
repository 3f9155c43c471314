"""The pieces `MoERuntime.build` (experts/runtime.py) assembles the runtime from: the slot
count of the GPU expert cache, `hybrid`'s fetch rule from the bandwidth profile, the prefill
layer streamer and its threshold, the CPU branch's threads, and `cpu`'s static fill."""
from __future__ import annotations

import os

import torch

from freetoken.experts.cost_model import BandwidthProfile
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.split import QStarRule
from freetoken.experts.stats import MoEStats
from freetoken.experts.store import ExpertStore
from freetoken.experts.streamer import LayerStreamer, StreamCosts, stream_threshold
from freetoken.log import get_logger, kv
from freetoken.types.config import WORKSPACE_MARGIN_BYTES, MoEConfig

log = get_logger("experts")
# DESIGN §9 figures, used only when no profile was measured on this machine
FALLBACK_BP, FALLBACK_BH = 48.5, 88.0


def q_rule_for(profile: BandwidthProfile | None, max_fetch: int | None) -> QStarRule:
    """`hybrid`'s q* rule from the profile's bandwidths (the overlapped pair when measured),
    else the fallback figures."""
    overlap = bool(profile and profile.has_overlap)
    b_p = (profile.b_p_overlap if overlap else
           profile.b_p if profile and profile.b_p else FALLBACK_BP)
    b_h = (profile.b_h_overlap if overlap else profile.b_h if profile else FALLBACK_BH)
    return QStarRule(b_p, b_h, overlap, max_fetch)


def slot_count(config: MoEConfig, pool: int, expert_bytes: int, device: torch.device,
               kv_reserve_bytes: int) -> int:
    """GPU expert slots: the option given (slots, rate of the pool, bytes), else what device
    memory leaves after the KV reserve and the workspace margin (the CPU: a quarter of the
    pool); between 1 and the pool."""
    if config.cache_size is not None:
        s = config.cache_size
    elif config.cache_rate is not None:
        s = round(config.cache_rate * pool)
    elif config.cache_mem is not None:
        s = config.cache_mem // expert_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        s = (free - kv_reserve_bytes - WORKSPACE_MARGIN_BYTES) // expert_bytes
    else:
        s = pool // 4
    return max(1, min(int(s), pool))


def stream_plan(config: MoEConfig, backend: str, cache: SlotCache, store: ExpertStore,
                profile: BandwidthProfile | None, top_k: int) -> tuple[int | None, str]:
    """The prefill stream's token threshold for `backend` (the option's, or from the profile's
    bandwidths) and where it came from."""
    if config.prefill_stream_tokens is not None:
        return config.prefill_stream_tokens, "option"
    b_p = (profile.b_p if profile and profile.b_p else FALLBACK_BP) * 1e9
    b_h = (profile.b_h if profile else FALLBACK_BH) * 1e9
    costs = StreamCosts(backend, store.num_experts, top_k, store.expert_bytes,
                        6.0 * store.hidden * store.intermediate,
                        min(1.0, cache.num_slots / (store.num_layers * store.num_experts)),
                        b_p, b_h)
    return stream_threshold(costs), "measured_profile" if profile else "fallback_bandwidths"


def make_streamer(config: MoEConfig, backend: str, cache: SlotCache, store: ExpertStore,
                  stats: MoEStats, profile: BandwidthProfile | None, top_k: int
                  ) -> LayerStreamer:
    """The prefill layer streamer, its token threshold from the profile (or the option)."""
    threshold, how = stream_plan(config, backend, cache, store, profile, top_k)
    log.info(kv("prefill_stream_plan", mode=config.prefill_stream, threshold=threshold, how=how,
                backend=backend, overlap=config.prefill_overlap,
                hit_d2d=config.prefill_hit_d2d))
    return LayerStreamer(cache, store, stats, threshold, mode=config.prefill_stream,
                         overlap=config.prefill_overlap, hits_in_place=config.prefill_hit_d2d,
                         seed=backend != "cpu")


def follow_guard(guard, streamer: LayerStreamer, config: MoEConfig, cache: SlotCache,
                 store: ExpertStore, profile: BandwidthProfile | None, top_k: int) -> None:
    """`auto`'s prefill stream follows what the guard runs: the threshold (and whether a
    stream seeds the cache) were planned for the profile's choice; once the guard settles
    elsewhere (a cpu choice overruled by hybrid keeps a cpu stream otherwise: no seeding,
    cpu's threshold), they are planned again for the backend it kept."""
    planned = [guard.choice]

    def on_change() -> None:
        if not guard.settled or guard.choice == planned[0]:
            return
        planned[0] = guard.choice
        streamer.threshold, how = stream_plan(config, guard.choice, cache, store, profile, top_k)
        streamer.seed = guard.choice != "cpu"
        log.info(kv("prefill_stream_plan", mode=config.prefill_stream,
                    threshold=streamer.threshold, how=how, backend=guard.choice,
                    why="auto_settled"))

    guard.listeners.append(on_change)


def default_cpu_threads(device: torch.device | str) -> int:
    """Threads for the CPU expert branch: torch's thread count (OMP_NUM_THREADS, else the
    cores), and with a GPU at most every core this process may run on less one, since the main
    thread drives the GPU meanwhile. The branch is one parallel call per layer that lasts as
    long as its slowest thread, so a kernel thread sharing a core with the thread that launches
    GPU work and fills slots (hybrid runs both at once) can hold up the whole call (inferred
    from the H200 decode profile, where hybrid ran at 17 tok/s beside offload's 43; the new
    default is not re-measured there yet)."""
    n = torch.get_num_threads()
    if torch.device(device).type == "cuda":
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        n = min(n, cores - 1)
    return max(1, n)


def prefill_static(cache: SlotCache, store: ExpertStore, slots: int) -> None:
    """`cpu` backend: fill the cache once with whole layers in order (a static split)."""
    E = store.num_experts
    for m in range(store.num_layers):
        n = min(E, slots - m * E)
        if n <= 0:
            break
        ids = torch.arange(n).view(1, n)
        d = cache.decide(m, ids, -1)
        cache.fill(m, d.fetch_experts, d.fetch_slots, store)
