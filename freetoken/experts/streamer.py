"""Prefill streaming: whole MoE layers through two buffers taken from the slot pool.

During a long prefill chunk nearly every expert of a layer is routed, so the fastest plan is to
move each layer's missing experts over the link exactly once and overlap that with compute
(DESIGN §4). For a chunk of at least `threshold` tokens (see `stream_threshold`):

1. `begin_forward`: the last `nbuf * E` slots of the pool become the buffers for the chunk
   (their experts are evicted); buffer b holds expert e of its layer in slot `base_b + e`. One
   host read of the residency table per chunk says which experts are resident and which slots
   are free.
2. Layer l fills buffer b = l % nbuf on a dedicated copy stream, started before l's routing is
   known: every expert of layer l that is not resident (with `hits_in_place`, the default,
   `--moe-prefill-hit-d2d`; without it, every expert) is copied from the pinned host store by
   the copy engine, one copy per run of consecutive experts, so the SMs stay free for compute.
   Resident experts are read in place from their slots: the device-to-device copy the design
   names moves zero bytes that way, since our MoE kernel reads any slot through its id.
3. Ordering is by CUDA events only: the compute stream waits `filled[l]` before layer l's
   experts; the fill of layer l + nbuf waits `free[b]`, recorded after layer l's compute. With
   two buffers the fill of l + 1 runs while l computes; `--no-prefill-overlap` (one buffer)
   serialises them, for comparison.
4. Seeding the decode cache: after layer l computes, its residents become the chunk's most
   routed experts (routed count, ties to the already resident), on the device: a hot expert
   that came through the buffer is copied device-to-device into the slot of a colder resident
   of the same layer, or into the layer's share of the free slots. (Not for `cpu`, whose split
   is static.)
5. `end_forward`: the buffer slots are left empty and go back to the LRU as its first victims.

Every row of the step (prefill chunk and any decode rows batched with it) reads layer l's
experts through the same map, so mixed batches stay identical to `fused`.

On the CPU device (tests) the same plan runs with plain index copies and no streams.

Shapes: E experts per layer, L MoE layers, S slots, T tokens, K top-k, H hidden.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from freetoken.experts.ffn import dispatch_experts, fused_moe
from freetoken.experts.slot_cache import SlotCache
from freetoken.experts.store import ExpertStore
from freetoken.kernels.quant import QuantBank
from freetoken.log import get_logger, kv

log = get_logger("experts")

# A dense bf16 GEMM rate well below an H100/H200's peak, used only to weigh the chunk's GPU
# compute against its transfers in `stream_threshold` (the choice is insensitive to it: at the
# thresholds it picks, compute is a few % of the link time).
GPU_MATMUL_FLOPS = 300e12
# Tokens per expert up to which the CPU expert kernel stays bound by memory bandwidth (B_H was
# measured at 1-8 tokens); beyond it, CPU time is taken to grow with the tokens.
CPU_BW_BOUND_TOKENS = 8


@dataclass(frozen=True)
class StreamCosts:
    """What `stream_threshold` weighs (bytes/s and bytes)."""

    backend: str
    experts: int
    top_k: int
    expert_bytes: int
    flops_per_token_expert: float  # 2 * 3 * H * I
    resident_rate: float  # fraction of each layer's experts resident in the cache
    b_p: float
    b_h: float


def routed_experts(tokens: int, top_k: int, experts: int) -> float:
    """Expected distinct experts a chunk of `tokens` routes in one layer (uniform routing)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def layer_times(c: StreamCosts, tokens: int) -> tuple[float, float]:
    """(streamed, per-expert path) seconds of one layer's experts for a chunk of `tokens`."""
    miss = 1.0 - c.resident_rate
    gpu = tokens * c.top_k * c.flops_per_token_expert / GPU_MATMUL_FLOPS
    stream = max(c.experts * miss * c.expert_bytes / c.b_p, gpu)
    u = routed_experts(tokens, c.top_k, c.experts)
    m_bytes = u * miss * c.expert_bytes
    per_expert = tokens * c.top_k / max(u, 1e-9)
    cpu_rate = c.b_h * min(1.0, CPU_BW_BOUND_TOKENS / max(per_expert, 1e-9))
    link = {"offload": c.b_p, "hybrid": c.b_p + cpu_rate, "cpu": cpu_rate}.get(c.backend, c.b_p)
    return stream, gpu + m_bytes / link


def stream_threshold(c: StreamCosts, max_tokens: int = 1 << 20) -> int | None:
    """The fewest chunk tokens from which streaming the layer is no slower than the per-expert
    path, or None when it never is (up to `max_tokens`). Streaming's cost is flat in the tokens
    (it moves the layer once) and the path's grows with them, so the first crossing is found by
    doubling and then bisecting."""
    def wins(t: int) -> bool:
        s, p = layer_times(c, t)
        return s <= p

    hi = 1
    while not wins(hi):
        hi *= 2
        if hi > max_tokens:
            return None
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


class LayerStreamer:
    """One model's prefill streamer over the shared slot cache (see the module docstring).

    `mode`: "auto" streams chunks of at least `threshold` tokens on CUDA; "on" streams every
    forward of at least `threshold` tokens on any device (the CPU device runs the same plan,
    for tests); "off" never streams."""

    def __init__(self, cache: SlotCache, store: ExpertStore, stats, threshold: int | None,
                 mode: str = "auto", overlap: bool = True, hits_in_place: bool = True,
                 seed: bool = True):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"prefill stream mode must be auto|on|off, got {mode!r}")
        self.cache, self.store, self.stats = cache, store, stats
        self.threshold, self.mode = threshold, mode
        self.overlap, self.hits_in_place, self.seed = overlap, hits_in_place, seed
        self.E, self.L = store.num_experts, store.num_layers
        self.streaming = False  # between a begin_forward that streams and its end_forward
        self.chunks = 0
        self._cuda = cache.device.type == "cuda"
        self._copy = torch.cuda.Stream(cache.device) if self._cuda else None
        self._t0 = 0.0
        self._tokens = 0

    # -- choice ------------------------------------------------------------------------------

    def buffers(self) -> int:
        """Buffers this cache can lend: 2 with overlap when it has 2E slots, else 1, else 0."""
        n = 2 if self.overlap else 1
        while n and self.cache.num_slots < n * self.E:
            n -= 1
        return n

    def wants(self, tokens: int) -> tuple[bool, str]:
        if self.mode == "off":
            return False, "off"
        if self.mode == "auto" and not self._cuda:
            return False, "not_cuda"
        if self.threshold is None:
            return False, "never_cheaper"
        if tokens < self.threshold:
            return False, "below_threshold"
        if self.buffers() == 0:
            return False, "cache_below_one_layer"
        if self._cuda and not self.cache.can_fill_on_device(self.store):
            return False, "no_pinned_store_or_triton"
        return True, "at_or_above_threshold"

    # -- the chunk ---------------------------------------------------------------------------

    def begin_forward(self, tokens: int) -> bool:
        """Called by the runtime's `step` before a forward of `tokens` tokens: decide, and when
        streaming, lend the buffers and start the first fills. Returns whether it streams
        (the step's MoE layers then run `forward`, mode `streamed`)."""
        self.streaming = False
        if tokens <= 1:  # decode steps: nothing to decide or log
            return False
        go, why = self.wants(tokens)
        quiet = why in ("below_threshold", "off", "not_cuda")  # every short step: debug only
        (log.debug if quiet else log.info)(kv(
            "prefill_path", tokens=tokens, path="stream" if go else "experts", reason=why,
            threshold=self.threshold))
        if not go:
            return False
        self.streaming, self.chunks = True, self.chunks + 1
        self._t0, self._tokens = time.perf_counter(), tokens
        self.nbuf = self.buffers()
        dev, E, L = self.cache.device, self.E, self.L
        t = self.cache.table
        S = t.num_slots
        self.base = [S - (self.nbuf - b) * E for b in range(self.nbuf)]  # buffer b: E slots
        self._evict_region(self.base[0])
        # one host read per chunk: which experts are resident (the fills are issued from the
        # host, so they ride the copy engine and leave the SMs to compute) and which slots are
        # free for seeding; neither changes for layers the chunk has not reached yet
        owner = t.slot_owner.cpu()
        self._resident = t.expert_slot.view(L, E).cpu()  # [L, E]
        free = torch.nonzero(owner[:self.base[0]] < 0).flatten()  # [F]
        share = free.numel() // L
        self._free = torch.zeros(L, E, dtype=torch.int64)  # [L, E]: each layer's free slots
        self._share = min(share, E)
        if self._share:
            self._free[:, :self._share] = free[:L * share].view(L, share)[:, :self._share]
        self._free = self._free.to(dev)
        self.filled: list = [None] * L  # CUDA events: layer m's buffer is full
        self.issued = [False] * L
        self.free_ev: list = [None] * self.nbuf
        self.fetched = 0
        self.seeded = torch.zeros((), dtype=torch.int64, device=dev)
        if self._copy is not None:  # the fills write slots the eviction above just released
            self._copy.wait_stream(torch.cuda.current_stream())
        for m in range(min(self.nbuf, L)):
            self._fill(m)
        return True

    def _evict_region(self, first: int) -> None:
        """Empty slots [first, S): the buffers."""
        t = self.cache.table
        G = t.expert_slot.numel()
        owner = t.slot_owner[first:]  # -1 for empty slots: sent to a sink entry
        gone = torch.zeros(G + 1, dtype=torch.bool, device=t.device)
        gone.index_fill_(0, torch.where(owner >= 0, owner, G), True)
        t.expert_slot.copy_(torch.where(gone[:G], -1, t.expert_slot))
        t.slot_owner[first:] = -1
        t.slot_last_use[first:] = -1

    def _fill(self, m: int) -> None:
        """Issue layer m's fill of buffer m % nbuf (on the copy stream on CUDA)."""
        b = m % self.nbuf
        self.issued[m] = True
        if self._copy is None:
            self._copy_runs(m, b)
            return
        with torch.cuda.stream(self._copy):
            if self.free_ev[b] is not None:
                self._copy.wait_event(self.free_ev[b])
            self._copy_runs(m, b)
            ev = torch.cuda.Event()
            ev.record(self._copy)
            self.filled[m] = ev

    def _copy_runs(self, m: int, b: int) -> None:
        """Copy layer m's experts into buffer b: expert e to slot base_b + e, one copy per run
        of consecutive experts (one per bank for a layer with nothing resident)."""
        need = (self._resident[m] < 0 if self.hits_in_place
                else torch.ones(self.E, dtype=torch.bool)).tolist()
        gu, dn, base = self.store.gate_up(m), self.store.down(m), self.base[b]
        c, e = self.cache, 0
        while e < self.E:
            if not need[e]:
                e += 1
                continue
            end = e
            while end < self.E and need[end]:
                end += 1
            c.gate_up_slots[base + e:base + end].copy_(gu[e:end], non_blocking=True)
            c.down_slots[base + e:base + end].copy_(dn[e:end], non_blocking=True)
            self.fetched += end - e
            e = end

    def forward(self, m: int, x: Tensor, topk_ids: Tensor, act=None) -> Tensor:
        """Layer m's unweighted expert outputs y [T, K, H] read from its buffer and its
        resident slots (`act`: the layer's ExpertAct bound to topk_ids, or None)."""
        E, b = self.E, m % self.nbuf
        if self.nbuf > 1 and m + 1 < self.L and not self.issued[m + 1]:
            self._fill(m + 1)  # waits for buffer (m+1) % nbuf to be released by layer m-1
        if self.filled[m] is not None:
            torch.cuda.current_stream().wait_event(self.filled[m])
        t = self.cache.table
        resident = t.expert_slot[m * E:(m + 1) * E].clone()  # [E] before this layer's seeding
        ids = torch.arange(E, device=resident.device)
        buf = self.base[b] + ids  # [E] buffer slot of each expert
        where = torch.where(resident >= 0, resident, buf) if self.hits_in_place else buf
        valid = topk_ids >= 0
        slot_ids = torch.where(valid, where[topk_ids.clamp(min=0)], -1)  # [T, K]
        T, K = topk_ids.shape
        y = torch.zeros(T, K, x.shape[-1], dtype=x.dtype, device=x.device)  # [T, K, H]
        c = self.cache
        if fused_moe(x, slot_ids, c.gate_up_slots, c.down_slots, y, act) is None:
            dispatch_experts(x, slot_ids, c.gate_up_slots, c.down_slots, y, mask=valid,
                             act=act)
        counts = torch.bincount(torch.where(valid, topk_ids, E).reshape(-1),
                                minlength=E + 1)[:E]  # [E], padding counted apart: no sync
        self._stats(resident, counts)
        if self.seed:
            self._seed(m, buf, resident, counts)
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            self.free_ev[b] = ev
        if m + 1 < self.L and not self.issued[m + 1]:
            self._fill(m + 1)  # one buffer: the next layer's fill waits for this compute
        return y

    def _stats(self, resident: Tensor, counts: Tensor) -> None:
        routed = counts > 0
        hit = (routed & (resident >= 0)).sum()
        miss = (routed & (resident < 0)).sum()
        self.stats.add_stream(torch.stack([hit, miss]))  # no host read

    def _seed(self, m: int, buf: Tensor, resident: Tensor, counts: Tensor) -> None:
        """Make layer m's residents the chunk's most routed experts (module docstring, step 4),
        on the device: a hot expert that came through the buffer is copied (device to device)
        into the slot of a cold resident it displaces, or into one of the layer's share of free
        slots. Every scatter below writes distinct slots: the buffer, the residents and the
        free slots are disjoint sets, and each map is one-to-one."""
        E, t = self.E, self.cache.table
        dev = resident.device
        es = resident  # [E] resident slot or -1
        res = es >= 0
        ids = torch.arange(E, device=dev)
        # rank by (count desc, resident first, id asc): a total order
        key = counts * (2 * E) + res.long() * E + (E - 1 - ids)  # [E]
        rank = torch.empty_like(ids).scatter_(0, torch.argsort(key, descending=True), ids)
        n_res = res.sum()
        keep = (rank < n_res) | ((rank < n_res + self._share) & (counts > 0))  # new residents
        up = keep & ~res  # in the buffer now, becomes resident
        down = res & ~keep  # resident, evicted for a hotter one
        # the i-th `up` expert takes the i-th `down` slot, then the layer's free slots
        n_down = down.sum()
        pd = torch.where(down, torch.cumsum(down.long(), 0) - 1, E)  # rank among down, E: sink
        down_by_rank = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_(0, pd, ids)
        pu = torch.where(up, torch.cumsum(up.long(), 0) - 1, 0)  # rank among up
        dest = torch.where(pu < n_down, es[down_by_rank[pu.clamp(max=E - 1)]],
                           self._free[m][(pu - n_down).clamp(0, E - 1)])  # [E] for `up`
        c = self.cache
        src_rows, dst_rows = torch.where(up, buf, -1), torch.where(up, dest, -1)
        if self._cuda:  # slot to slot on the device, codes and scales alike when quantized
            from freetoken.kernels.triton.uva_fill import fill_banks, fill_pair

            fill = fill_banks if isinstance(c.gate_up_slots, QuantBank) else fill_pair
            fill(c.gate_up_slots, c.gate_up_slots, c.down_slots, c.down_slots, src_rows,
                 dst_rows)
        else:
            sel = up.nonzero().flatten()
            c.gate_up_slots.index_copy_(0, dest[sel], c.gate_up_slots.index_select(0, buf[sel]))
            c.down_slots.index_copy_(0, dest[sel], c.down_slots.index_select(0, buf[sel]))
        base, now = m * E, t.clock[0]
        t.expert_slot[base:base + E] = torch.where(up, dest, torch.where(down, -1, es))
        # cold residents leave (targets: their slot, or a buffer slot where nothing changes)
        cold = torch.where(res, es, buf)
        t.slot_owner[cold] = torch.where(down, -1, t.slot_owner[cold])
        t.slot_last_use[cold] = torch.where(down, -1, t.slot_last_use[cold])
        # hot ones arrive; residents the chunk routed are recent now
        hot = torch.where(up, dest, torch.where(res & keep, es, buf))
        t.slot_owner[hot] = torch.where(up, base + ids, t.slot_owner[hot])
        t.slot_last_use[hot] = torch.where(up | (res & keep & (counts > 0)), now,
                                           t.slot_last_use[hot])
        self.seeded += up.sum()

    def end_forward(self) -> None:
        """After the last layer: release the buffers (their slots are empty) and log."""
        if not self.streaming:
            return
        self.streaming = False
        self.cache.table.clock += 1
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._copy)
        fetched, seeded = self.fetched, int(self.seeded)  # one read per chunk
        self.stats.stream_bytes += fetched * self.store.expert_bytes
        self.stats.streamed += fetched
        log.info(kv("prefill_stream", tokens=self._tokens, layers=self.L, buffers=self.nbuf,
                    fetched=fetched, gb=f"{fetched * self.store.expert_bytes / 1e9:.2f}",
                    seeded=seeded, issue_ms=f"{1e3 * (time.perf_counter() - self._t0):.1f}"))
